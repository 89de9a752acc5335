"""torch on one thread: the oracle runs tiny matrices, where torch's thread pool costs far more than
it saves on a shared CPU. Results do not change."""
import torch

torch.set_num_threads(1)
