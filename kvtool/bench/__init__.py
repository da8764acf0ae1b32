"""Benchmarks: tables of cases measured against the device-to-device copy bandwidth of the same run."""
