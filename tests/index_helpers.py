"""Shared helpers of the index-scorer tests (kernel, workflow and bench): a paged index cache of random keys and
bf16 queries, on the tests' device."""

import torch

from conftest import DEVICE
from kvtool.formats import get_format
from kvtool.paged import PagedCache, contiguous_slots


def make_cache(label, ctx, page=16, dim=128, seed=0, keys=None, device=DEVICE, shuffle=True):
    """A paged index cache holding per-request keys (heavy-tailed channels unless given), pages in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    table, slots = contiguous_slots(ctx, page)
    num_pages = int(table.max()) + 1 if table.numel() else 1
    if shuffle and num_pages > 1:  # requests own scattered pages, as in an engine
        perm = torch.randperm(num_pages, generator=g).to(torch.int32)
        table = torch.where(table >= 0, perm[table.clamp(min=0).long()], -1)
        slots = [perm[(s // page)].long() * page + s % page for s in slots]
    if keys is None:
        chan = torch.exp(1.5 * torch.randn(dim, generator=g))
        keys = [torch.randn(n, 1, dim, generator=g) * chan for n in ctx]
    cache = PagedCache.allocate(get_format(label), max(num_pages, 1), page, 1, dim, device=device)
    for k, s in zip(keys, slots):
        cache.store(k.to(device), s.to(device))
    return cache, table.to(device), torch.tensor(ctx, dtype=torch.int32, device=device), slots


def queries(b, hi, dim, seed=1, q=None):
    g = torch.Generator().manual_seed(seed)
    shape = (b, hi, dim) if q is None else (b, q, hi, dim)
    return torch.randn(shape, generator=g).to(torch.bfloat16).to(DEVICE)
