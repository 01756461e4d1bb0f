"""The planner kernels' error words: ``err [3]`` = (code, a, b), written by the CPU and the CUDA kernel alike.

Plain integers, no imports: the kernels compile them in as constants, and ``planner.tables.raise_error``
turns a triple into the ValueError that names the problem (``OVERFLOW``: ``planner.tensor_plan``).
"""

OK = 0
NEGATIVE = 1  # (r, e): a negative count
CAPS_SUM = 2  # (sum caps, total): caller caps that do not sum to the total
INFEASIBLE = 3  # (h, u): donor h cannot fill receiver u alone (caps too uneven)
TOO_MANY_REPLICAS = 4  # (d, n): rank d needs n replica slots, more than slots_per_rank
TOO_LARGE = 5  # (r, e): a count, or (r, -1): a rank's cap, does not fit the int32 plan tables
OVERFLOW = 6  # (flows, rows): the device kernel's flow table is too small (impossible within flow_rows)
EXPERT_TOO_LARGE = 7  # (e, total): an expert's slots over all ranks do not fit alloc
NO_ERROR_POS = 2**62  # the device kernel's first-bad-count position before any bad count was seen
