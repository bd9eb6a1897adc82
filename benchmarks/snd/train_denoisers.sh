#!/usr/bin/env bash
# Trains the SnD ablation denoisers for `privlm bench snd`, all at the same budget
# (800 steps of 32 texts from 20,000 WordNet texts, seed 0), one after the other:
#   snd/     the SnD denoiser itself, eta-conditioned over [15, 150]
#   server/  sees only e_n and X~ (what the server could do itself)
#   local/   e_n zeroed: a local model of the user's own clean tokens
#   noclip/  SnD trained and used without norm clipping
#   noresidual/  SnD whose output is the head at position 0 alone (the paper), not e_n + head
#   query/   SnD read at an extra learned query row, e_n an ordinary input row, no residual:
#            the local-only model plus e_n, so it can do no worse once trained
#   groups/  one denoiser per eta group (two etas each), 800/3 steps each: equal total compute
# Usage: benchmarks/snd/train_denoisers.sh [OUT]   (default runs/denoisers/ablations; ~50 min on 2 idle cores)
set -euo pipefail
out=${1:-runs/denoisers/ablations}
privlm=${PRIVLM:-.venv/bin/privlm}
common=(--model minilm --sources wordnet --max-texts 20000 --eval-every 200 --patience 100 --minutes 30 --seed 0)
"$privlm" snd train --out "$out/snd" "${common[@]}" --eta-min 15 --eta-max 150 --max-steps 800
"$privlm" snd train --out "$out/server" "${common[@]}" --eta-min 15 --eta-max 150 --max-steps 800 --variant server
"$privlm" snd train --out "$out/local" "${common[@]}" --eta-min 15 --eta-max 150 --max-steps 800 --variant local
"$privlm" snd train --out "$out/noclip" "${common[@]}" --eta-min 15 --eta-max 150 --max-steps 800 --no-clip
"$privlm" snd train --out "$out/noresidual" "${common[@]}" --eta-min 15 --eta-max 150 --max-steps 800 --no-residual
"$privlm" snd train --out "$out/query" "${common[@]}" --eta-min 15 --eta-max 150 --max-steps 800 --no-residual --readout query
"$privlm" snd train --out "$out/groups/low" "${common[@]}" --etas 15,25 --max-steps 267
"$privlm" snd train --out "$out/groups/mid" "${common[@]}" --etas 35,55 --max-steps 267
"$privlm" snd train --out "$out/groups/high" "${common[@]}" --etas 80,130 --max-steps 267
