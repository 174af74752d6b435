#!/usr/bin/env bash
# EAGLE-3 draft heads (issue 50, item 4): train one for the embedded model, then measure it against the self-int4
# draft at 64 new tokens, greedy and sampling, on the few-row kernels (docs/results.md, "EAGLE-3 draft heads").
# One thread each, nothing else running. Training ~40 minutes (generation ~16, teacher pass ~7, 10 epochs ~16),
# each measurement ~2-4 minutes.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
R=bench/results
H=${HEAD:-runs/eagle_head}
compress draft-head default --output "$H" --holdout 32 --threads 1 \
  --cache runs/eagle_data
for t in 0 0.8; do
  compress speculate default --draft "$H" --k 1-4 --prompts 8 --max-new-tokens 64 --temperature $t \
    --output $R/speculative_eagle_64_t$t.json
  compress speculate default --draft self-int4 --k 2-5 --prompts 8 --max-new-tokens 64 --temperature $t \
    --output $R/speculative_self_int4_64_t$t.json
done
# the head trained with text too (at two threads; the same generations from the cache)
compress draft-head default --output "${H}_text" --holdout 32 --threads 2 --text-sequences 960 --epochs 5 \
  --cache runs/eagle_data
for t in 0 0.8; do
  compress speculate default --draft "${H}_text" --k 1-4 --prompts 8 --max-new-tokens 64 --temperature $t \
    --output $R/speculative_eagle_text_64_t$t.json
done
# draft trees with the text-trained head (--tree DEPTH,BRANCH,TOKENS): shapes compared on test prompts disjoint from
# the reported ones (--prompt-offset 0.5), the chosen one reported on the usual prompts beside the chain
for t in 0 0.8; do
  compress speculate default --draft "${H}_text" --k 2 --no-adaptive --prompts 8 --max-new-tokens 64 --temperature $t \
    --prompt-offset 0.5 --tree-sampling top --tree 5,4,15 --tree 6,3,15 --tree 4,4,11 --tree 4,2,7 --tree 3,2,5 \
    --output $R/speculative_tree_shapes_t$t.json
done
# reported: the chain beside the chosen tree (3,2,5) and the largest (5,4,15), then with the head's layer in int8
# (these sampled trees with the head's top tokens, the only rule before 18f2330)
for t in 0 0.8; do
  compress speculate default --draft "${H}_text" --k 2 --no-adaptive --prompts 8 --max-new-tokens 64 --temperature $t \
    --tree-sampling top --tree 3,2,5 --tree 5,4,15 --output $R/speculative_eagle_tree_64_t$t.json
  compress speculate default --draft "${H}_text" --head-int8 --k 2 --no-adaptive --prompts 8 --max-new-tokens 64 \
    --temperature $t --tree-sampling top --tree 3,2,5 --output $R/speculative_eagle_int8_tree_64_t$t.json
done
# sampled trees with drawn nodes (--tree-sampling drawn, the default since 18f2330): shapes, then the reported prompts
compress speculate default --draft "${H}_text" --head-int8 --k 2 --no-adaptive --prompts 8 --max-new-tokens 64 \
  --temperature 0.8 --prompt-offset 0.5 --tree 3,2,5 --tree 4,2,7 --tree 4,3,10 --tree 5,4,15 \
  --output $R/speculative_tree_drawn_shapes_t0.8.json
compress speculate default --draft "${H}_text" --head-int8 --k 2 --no-adaptive --prompts 8 --max-new-tokens 64 \
  --temperature 0.8 --tree 3,2,5 --tree 5,4,15 --output $R/speculative_eagle_int8_drawn_tree_64_t0.8.json
