"""simulator: capacity planning for MoE and dense training clusters (pure model code: no torch.distributed).

    from simulator import ParallelConfig, simulate, search, whatif
    res = simulate("k3", "h200", ParallelConfig(pp=16, ep=64, dp=256, seq_len=8192,
                                                  global_batch_tokens=64 * 2**20, recompute="full"), gpus=4096)
    res.to_dict()   # step_time_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu, memory_gib_per_gpu, breakdown, ...

Engines: ``simulate(..., engine="analytic")`` (closed form, for search) and ``engine="event"`` (one
pipeline's schedule op by op). ``moonep simulate run | search | whatif | calibrate`` is the command line.
"""

from simulator.analytic import Perturbation, SimResult, simulate
from simulator.feasibility import infeasible_reason
from simulator.hardware import PRESETS as HARDWARE_PRESETS
from simulator.hardware import Efficiency, HardwareSpec, HostSpec, load_hardware
from simulator.hf_config import from_config_object, from_hf_config
from simulator.layers import ParamCounts, model_flops_per_token, param_counts
from simulator.memory import inference_memory, peak_memory, rank_memory
from simulator.modelspec import ModelSpec
from simulator.network import ClusterSpec, build_graph
from simulator.parallel import ParallelConfig
from simulator.search import SearchSpace, search
from simulator.specs import PRESETS as MODEL_PRESETS
from simulator.specs import load_model
from simulator.whatif import whatif

__all__ = [
    "simulate",
    "SimResult",
    "Perturbation",
    "search",
    "SearchSpace",
    "whatif",
    "ParallelConfig",
    "infeasible_reason",
    "ModelSpec",
    "MODEL_PRESETS",
    "load_model",
    "from_hf_config",
    "from_config_object",
    "HardwareSpec",
    "Efficiency",
    "HostSpec",
    "HARDWARE_PRESETS",
    "load_hardware",
    "ClusterSpec",
    "build_graph",
    "param_counts",
    "ParamCounts",
    "model_flops_per_token",
    "peak_memory",
    "rank_memory",
    "inference_memory",
]
