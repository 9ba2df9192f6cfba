"""Each rank prints the examples a DataLoader with a DistributedSampler (defaults from the
launcher's environment) gives it in epochs 0 and 1."""
from __future__ import annotations

import json

import numpy as np

from needle.data import DataLoader, DistributedSampler, NDArrayDataset

data = NDArrayDataset(np.arange(13, dtype=np.float32).reshape(13, 1))
sampler = DistributedSampler(data, seed=11)
loader = DataLoader(data, 3, sampler=sampler)
seen = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    seen.append([int(v) for batch in loader for v in batch[0].numpy().ravel()])
print("SHARDS", json.dumps({"rank": sampler.rank, "world": sampler.num_replicas,
                            "epochs": seen}), flush=True)
