import torch

torch.set_num_threads(1)  # the machine is shared; every test here is sized for one thread
