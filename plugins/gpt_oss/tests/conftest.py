"""torch on one thread: the oracle runs tiny matrices, where torch's thread pool costs 10× more
than it saves on a shared CPU (GLM's greedy oracle: 14 s → 0.8 s). Results do not change."""
import torch

torch.set_num_threads(1)
