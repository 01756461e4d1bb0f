"""Calibration runs: the published Megatron-Bridge rows on Blackwell Ultra (DGX-B300, DGX-GB300), disjoint from
the validation rows of ``simulator.published`` by system.

The simulator fits what software sets and first principles cannot (``simulator.software_fit``) on these rows
only, then is validated on H100 / B200 / GB200 rows it never saw. Same rule as the validation table: the newest
pre-training row for each (model, system, precision) whose model is a preset; recipe settings from the
Megatron-Bridge recipe files (``src/megatron/bridge/perf_recipes/<family>/{b300,gb300}/*.py``). Blackwell Ultra
runs the same software stack and the same dense BF16 / FP8 tensor peaks as B200 / GB200 (``hardware.py``), so a
software overhead measured here carries over; the hardware differs (160 SMs, 288 GB, 800 Gb/s NICs) and is
priced from its datasheet.
"""

from __future__ import annotations

from simulator.published import Published, parse_table

# fmt: off
_TABLE = """
deepseek-v3     | b300  |  256 | fp8  | 4096 | 2 | 4096 | 1 | 8 | 1 | 1  |  8 |  3541 |  920 | A 26.06 | mtp=1,layout=8+5,graph=modules,dispatcher=deepep,modules=mla_up_proj,recipe=deepseek_v3_pretrain_256gpu_b300_fp8mx_config
gpt-oss-120b    | b300  |   64 | fp8  | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  |  8 | 18534 |  604 | A 26.06 | graph=modules,recompute=none,dispatcher=deepep,recipe=gpt_oss_120b_pretrain_64gpu_b300_fp8mx_config
gpt-oss-120b    | b300  |   64 | bf16 | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  |  8 | 15232 |  414 | A 26.04.01 | graph=modules,recompute=none,dispatcher=deepep,recipe=gpt_oss_120b_pretrain_64gpu_b300_bf16_config
qwen3-235b-a22b | b300  |  256 | fp8  | 8192 | 2 | 4096 | 1 | 8 | 1 | 1  |  8 |  5936 |  878 | A 26.04.01 | layout=11+11,dispatcher=deepep,recompute=none,recipe=qwen3_235b_a22b_pretrain_256gpu_b300_fp8mx_config
qwen3-30b-a3b   | b300  |    8 | fp8  |  512 | 8 | 4096 | 1 | 1 | 1 | 1  |  8 | 40769 |  938 | A 26.06 | a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,dispatcher=deepep,recompute=none,recipe=qwen3_30b_a3b_pretrain_8gpu_b300_fp8mx_config
deepseek-v3     | gb300 |  256 | fp8  | 4096 | 1 | 4096 | 1 | 2 | 1 | 8  | 32 |  6288 | 1635 | C 26.08 | mtp=1,layout=4+1,a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,dispatcher=deepep,recompute=none,recipe=deepseek_v3_pretrain_256gpu_gb300_fp8mx_config
deepseek-v3     | gb300 |  256 | bf16 | 4096 | 1 | 4096 | 1 | 2 | 1 | 4  | 32 |  3848 |  961 | A 25.11 | graph=modules,dispatcher=deepep,modules=moe_act,note=DeepSeekV3 (w/o MTP)
gpt-oss-120b    | gb300 |   64 | fp8  | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  | 16 | 33024 | 1077 | C 26.08 | dispatcher=deepep,a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,recompute=none,recipe=gpt_oss_120b_pretrain_64gpu_gb300_fp8mx_config
gpt-oss-120b    | gb300 |   64 | bf16 | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  | 64 | 19200 |  523 | A 26.04.01 | graph=modules,recompute=none,recipe=gpt_oss_120b_pretrain_64gpu_gb300_bf16_config
kimi-k2         | gb300 |  256 | fp8  | 4096 | 2 | 4096 | 1 | 4 | 1 | 4  | 64 |  5372 | 1099 | A 26.06 | layout=4+1,dispatcher=deepep,modules=mla_up_proj,grads=fp32,recipe=kimi_k2_pretrain_256gpu_gb300_fp8mx_config
qwen3-235b-a22b | gb300 |  256 | fp8  | 8192 | 2 | 4096 | 1 | 4 | 1 | 12 | 32 |  8816 | 1306 | C 26.08 | layout=1+1,a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,dispatcher=deepep,recompute=none,recipe=qwen3_235b_a22b_pretrain_256gpu_gb300_fp8mx_config
qwen3-235b-a22b | gb300 |  256 | bf16 | 8192 | 2 | 4096 | 1 | 4 | 1 | 12 | 16 |  6131 |  907 | A 25.11 | layout=1+1,graph=modules,dispatcher=deepep,recompute=none
qwen3-30b-a3b   | gb300 |    8 | fp8  |  512 | 8 | 4096 | 1 | 1 | 1 | 1  |  8 | 44544 | 1029 | C 26.08 | a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,dispatcher=deepep,recompute=none,recipe=qwen3_30b_a3b_pretrain_8gpu_gb300_fp8mx_config
llama3-405b     | gb300 |  256 | fp8  | 1536 | 1 | 8192 | 4 | 8 | 1 | 4  |  1 |  1048 | 2646 | A 26.06 | layout=3+3,recipe=llama31_405b_pretrain_256gpu_gb300_fp8cs_config
llama3-70b      | gb300 |   64 | fp8  |  256 | 2 | 8192 | 1 | 1 | 1 | 1  |  1 |  5248 | 2348 | A 26.04.01 | fsdp=1,offload=0.25,recipe=llama3_70b_pretrain_64gpu_gb300_fp8cs_config (cpu_offloading_num_layers 20 of 80)
llama3-8b       | gb300 |    8 | fp8  |  128 | 2 | 8192 | 1 | 1 | 1 | 1  |  1 | 37556 | 1933 | A 25.11 |
"""  # noqa: E501 (a table copied row by row from its sources)
# fmt: on

ROWS: tuple[Published, ...] = parse_table(_TABLE)
