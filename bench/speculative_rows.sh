#!/usr/bin/env bash
# Speculative decoding on the few-row CPU kernels (README, "Speculative decoding with our own drafts").
# Needs runs/spec_awq_gptq_int4: compress run recipes/awq_gptq_int4.yaml --set output.dir=runs/spec_awq_gptq_int4
# One thread each, nothing else running; about 15 minutes on a 2-core VM.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
D="--draft runs/spec_awq_gptq_int4 --draft-int4"
R=bench/results
compress speculate default $D --k 3-7 --prompts 8 --max-new-tokens 64 --accelerator H100-SXM --output $R/speculative_rows_awq_gptq_int4_64.json
compress speculate default $D --k 4-6 --prompts 8 --max-new-tokens 128 --output $R/speculative_rows_awq_gptq_int4_128.json
compress speculate default $D --k 4-6 --no-adaptive --prompts 4 --max-new-tokens 256 --output $R/speculative_rows_awq_gptq_int4_256.json
compress speculate default $D --k 3-5 --no-adaptive --prompts 8 --max-new-tokens 128 --temperature 0.8 --output $R/speculative_rows_awq_gptq_int4_128_t08.json
compress speculate default --draft self-int4 --k 3-5 --no-adaptive --prompts 8 --max-new-tokens 128 --output $R/speculative_rows_self_int4_128.json
compress speculate default $D --k 5 --no-adaptive --prompts 8 --max-new-tokens 128 --draft-act float --output $R/speculative_rows_awq_gptq_int4_128_float_act.json
compress speculate default $D --k 4,5 --no-adaptive --prompts 8 --max-new-tokens 64 --kernels torch --output $R/speculative_torch_awq_gptq_int4_64.json
