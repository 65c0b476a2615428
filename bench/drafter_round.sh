#!/usr/bin/env bash
# On the GPU machine (after the stage-for-device.sh stashes): one round of the block-drafter recipe.
#   bash bench/drafter_round.sh data    # build the training data under $DATA (default /tmp/drafter_data);
#                                       # its shards and manifest come back under $OUT/data. PART=I/N builds
#                                       # part I of N (a large set over several calls; train on every part);
#                                       # it stops after $DATA_SECONDS (default 480) with what is finished, and
#                                       # DATA=<a folder it brought back, carried> with the same knobs resumes it
#   bash bench/drafter_round.sh train   # train DFlash and DSpark side by side on $DATA for $SECONDS_BUDGET (default
#                                       # 420), one process and one target forward a step for both (JOINT=0: a
#                                       # process each), into specdec/drafters/checkpoints/ (RESUME=1: continue the
#                                       # checkpoints there); both checkpoint folders come back as
#                                       # $OUT/checkpoints.tar.N pieces (cat them | tar -x), with the logs
#                                       # STEPS=N plans N steps instead and stops after $SECONDS_BUDGET: a plan
#                                       # longer than one call, continued by the next with RESUME=1 (carry the
#                                       # checkpoints it brought back into specdec/drafters/checkpoints/)
#   bash bench/drafter_round.sh round   # train (INIT=1, SECONDS_BUDGET 240, the repo's data) then e2e at batch 1 and 8:
#                                       # one call of at most 9.5 minutes (with RESUME=1 it continues their plan)
#   bash bench/drafter_round.sh trainsplit # a training step's parts on the GPU at 16, 32 and 64 sequences a step
#                                       # (bench/train_split.py): side by side against one kind after the other
#   bash bench/drafter_round.sh jointcheck # ms a step: both kinds in one process (JOINT=1) against a process each
#   bash bench/drafter_round.sh eval    # e2e on HumanEval 100-163 and Spec-Bench (carried as .evaldata/question.jsonl)
#   bash bench/drafter_round.sh chain   # the chained plain steps of a gated engine: their GPU test (CUDA graphs), then
#                                       # e2e on HumanEval 100-163 at batch 8 and 32, null beside DFlash with and without
#                                       # the gate (needs only the DFlash checkpoint: fits one call with the last stash)
#   bash bench/drafter_round.sh fold    # propose ms with a KV head's query heads folded into query rows (the default)
#                                       # beside one head at a time (NAME+unfolded), batch 1, 8, 32
#   bash bench/drafter_round.sh plain   # e2e at batch 32: null, DFlash behind a gate that never drafts (every step
#                                       # chained: what the drafter costs a plain step), DFlash + gate; with cProfile
#                                       # and the gate's measured steps (--gate-history; chain too)
#   OTHER=DIR bash bench/drafter_round.sh other # e2e at batch 1 and 32: the shipped DFlash beside the checkpoint in DIR
#   bash bench/drafter_round.sh gate    # e2e on HumanEval 100-163, batch 1, 8, 32: each drafter with and without
#                                       # draft_gate (+gate); gatesb: the same on 78 Spec-Bench first turns
#   bash bench/drafter_round.sh gputests # GPU tests of block-drafter propose (graphs, staged context writes) and sampling
#   bash bench/drafter_round.sh hostprofile # e2e at batch 1 with cProfile of each drafter's host functions
#   bash bench/drafter_round.sh hybrid  # e2e at batch 1 and 8 (BATCHES): null, suffix, DFlash and both hybrids
#   bash bench/drafter_round.sh depth   # a deeper DFlash (GROW=N train first, same machine) beside the shipped one:
#                                       # propose ms at batch 1, 8, 32 and e2e at batch 1 and 32
#   bash bench/drafter_round.sh ring    # the staging ring: its GPU tests, e2e at batch 32 (null, DFlash, + gate, the plain
#                                       # regime) here and in a baseline tree (BASE, carried), then batch 1 here
#   bash bench/drafter_round.sh gatecheck # the gate at batch 1 on Spec-Bench 0-79 and at batch 32 on HumanEval (3 runs),
#                                         # here and in a baseline tree (BASE, carried)
#   bash bench/drafter_round.sh gatesb32 # the gate at batch 32 on Spec-Bench 0-239: null, the plain regime, DFlash + gate,
#                                       # then null and DFlash + gate in a baseline tree (BASE, carried)
#   bash bench/drafter_round.sh devdrafts # drafts left on the device (+devdrafts): its GPU test, then e2e at batch 1
#                                         # and 8 beside the same drafters reading their drafts back (the default)
# Knobs: MAGPIE, CODE, GROUNDED, MATH, DOCS, HEVAL (prompts of each source; DOC_SOURCES: earlier builds whose
# passages the documents also use), SAMPLED (fraction with a sampled response too), BATCH, PART,
# SEED (data), MAXTOK (new tokens per response); DATA may name several folders (the parts), space-separated,
# for train; INIT=1 starts train from the checkpoints in the repo with a new plan (RESUME=1 continues theirs;
# RESUME=/tmp/ck-{kind} continues the last call's on the same warm machine, nothing carried back first);
# LR (peak learning rate, default 1e-3); MAXLEN (tokens of each sequence trained on; default 1024, or a resumed
# run's own); SEQS (sequences a training step, default 16); GROW=N (with INIT) deepens both networks to N layers
# first (--grow-layers: new layers add nothing until trained); GREEDY=1 labels slots with the target's greedy
# continuation (--greedy-labels); COMPILE_LOSS=1 fuses the
# loss's passes over the vocabulary with torch.compile (--compile-loss); trainsplit: SPLIT_SEQS (sizes) and LOOP
# (steps of the training loop itself timed with the plain and the compiled loss, default 20).
# FROM=/tmp/ck-{kind}: before any part, install the checkpoints a train part left on this warm machine
# (each call copies the working tree again, so the repo's checkpoints are back to the committed ones:
# an eval in a later call without FROM measures those, not the new ones).
set -uo pipefail
. /tmp/stage/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DATA=${DATA:-/tmp/drafter_data}
CK=specdec/drafters/checkpoints
mkdir -p "$OUT"
if [ -n "${FROM:-}" ]; then  # both checked before either is replaced
  case "$FROM" in *"{kind}"*) ;; *) echo "FROM must name the kind as {kind}, e.g. /tmp/ck-{kind}"; exit 1 ;; esac
  for kind in dflash dspark; do
    [ -f "${FROM//\{kind\}/$kind}/train_state.json" ] || { echo "FROM: no checkpoint at ${FROM//\{kind\}/$kind}"; exit 1; }
  done
  for kind in dflash dspark; do
    rm -rf "$CK/smollm2-135m-$kind" && cp -r "${FROM//\{kind\}/$kind}" "$CK/smollm2-135m-$kind" \
      && echo "installed ${FROM//\{kind\}/$kind}"
  done
fi
for part in "$@"; do
  case "$part" in
    smoke)  # a minute: a tiny data build (sampled responses too) and 30 training steps of each kind
      timeout 150 python -m specdec.drafters.data --out /tmp/smoke_data --num-magpie 64 --num-code 64 \
        --num-grounded 16 --num-math 16 --num-humaneval 8 \
        --sampled-fraction 0.3 --max-new-tokens 48 --batch-size 64 --device cuda 2>&1 | grep -v "it/s\]$" | tail -3
      for kind in dflash dspark; do
        timeout 150 python -m specdec.drafters.training --data /tmp/smoke_data --kind $kind --out /tmp/smoke-$kind \
          --steps 30 --val-every 15 --val-fraction 0.1 2>&1 | tail -3
      done ;;
    data)
      timeout 570 python -m specdec.drafters.data --out "$DATA" --num-magpie "${MAGPIE:-20000}" \
        --num-code "${CODE:-20000}" --sampled-fraction "${SAMPLED:-0}" --batch-size "${BATCH:-256}" \
        --part "${PART:-0/1}" --seed "${SEED:-0}" --max-new-tokens "${MAXTOK:-384}" \
        --num-grounded "${GROUNDED:-10000}" --num-math "${MATH:-5000}" --num-humaneval "${HEVAL:-100}" \
        --num-documents "${DOCS:-0}" ${DOC_SOURCES:+--document-sources $DOC_SOURCES} \
        --max-seconds "${DATA_SECONDS:-480}" --save-every 60 --device cuda 2>&1 \
        | tr '\r' '\n' | grep -v "it/s\]$" | tail -20 | tee "$OUT/data_log.txt"
      mkdir -p "$OUT/data" && cp "$DATA"/manifest.json "$DATA"/shard-*.npz "$DATA"/jobs.json.gz "$OUT/data/" ;;
    train)
      # a plan of $STEPS steps cut after $SECONDS_BUDGET (continued by RESUME=1), or a plan fitted to the budget
      plan="--max-seconds ${SECONDS_BUDGET:-420}"
      [ -n "${STEPS:-}" ] && plan="--steps $STEPS --stop-after ${SECONDS_BUDGET:-420}"
      plan="$plan --lr ${LR:-1e-3} --seqs-per-step ${SEQS:-16} ${MAXLEN:+--max-len $MAXLEN}${COMPILE_LOSS:+ --compile-loss}${GROW:+ --grow-layers $GROW}${GREEDY:+ --greedy-labels}"
      start=""  # where each kind starts, {kind} in the folder: RESUME continues a plan, INIT starts a new one
      if [ "${RESUME:-}" = 1 ]; then start="--resume $CK/smollm2-135m-{kind}"
      elif [ -n "${RESUME:-}" ]; then start="--resume $RESUME"  # e.g. /tmp/ck-{kind}: the last call's
      elif [ -n "${INIT:-}" ]; then start="--init $CK/smollm2-135m-{kind}"; fi
      if [ "${JOINT:-1}" = 1 ]; then  # both kinds in one process: one target forward a step feeds both
        timeout 580 python -m specdec.drafters.training --data $DATA --kind dflash,dspark --out "/tmp/ck-{kind}" \
          $plan $start > "$OUT/train.log" 2>&1
        tail -8 "$OUT/train.log"
      else  # JOINT=0: one process per kind, side by side on the GPU
        for kind in dflash dspark; do
          timeout 580 python -m specdec.drafters.training --data $DATA --kind $kind --out "/tmp/ck-$kind" \
            $plan ${start//\{kind\}/$kind} > "$OUT/train_$kind.log" 2>&1 &
        done
        wait
        tail -5 "$OUT"/train_*.log
      fi
      for kind in dflash dspark; do  # only a run that wrote a checkpoint replaces the repo's
        if [ -f "/tmp/ck-$kind/train_state.json" ]; then
          rm -rf "$CK/smollm2-135m-$kind" && cp -r "/tmp/ck-$kind" "$CK/smollm2-135m-$kind"
        else
          echo "no checkpoint from the $kind run: $CK/smollm2-135m-$kind kept"
        fi
      done
      # at most 8 files of 16 MiB come back: both checkpoints in one archive, in 15 MiB pieces
      # (locally: cat checkpoints.tar.* | tar -x)
      tar -C /tmp -cf - ck-dflash ck-dspark | split -b 15M -d -a 1 - "$OUT/checkpoints.tar." ;;
    round)  # one call: train both kinds from the repo's checkpoints (INIT) for $SECONDS_BUDGET (default 240) on the
            # repo's data sets (every data/drafter-smollm2-135m*/, or DATA_SETS), then e2e at batch 1 and 8 with the
            # new weights beside null and suffix
      DATA="${DATA_SETS:-$(ls -d data/drafter-smollm2-135m*/ | tr '\n' ' ')}" INIT=1 \
        SECONDS_BUDGET="${SECONDS_BUDGET:-240}" bash "$0" train
      timeout 270 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes "${BATCHES:-1,8}" --drafters null,suffix,dflash+nogate,dspark+nogate,hybrid,hybrid+nocost,hybrid+dflash --skip-hf \
        --out "$OUT/e2e_round" 2>&1 | grep "^|\|^- " ;;
    eval)
      timeout 250 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --drafters null,suffix,dflash+nogate,dspark+nogate,dspark+nogate+conf,dflash --skip-hf --out "$OUT/e2e_humaneval" \
        2>&1 | grep "^|"
      timeout 300 python bench/e2e.py --device cuda --dtype bfloat16 --spec-bench .evaldata/question.jsonl \
        --problems 0-479 --max-new-tokens 256 --batch-sizes 8,32 --drafters null,suffix,dflash+nogate,dspark+nogate,dspark+nogate+conf,dflash \
        --skip-hf --out "$OUT/e2e_specbench" 2>&1 | grep "^|" ;;
    chain)  # a gated engine's plain steps chained (overlapped): the GPU test, then null / DFlash / DFlash + gate
      timeout 150 python -m pytest tests/test_draft_gate.py -m gpu -p no:cacheprovider -rA -o addopts= 2>&1 \
        | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" | head -40 | tee "$OUT/gpu_tests_gate.txt"
      timeout 300 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 8,32 --drafters null,dflash+nogate,dflash --skip-hf --gate-history --out "$OUT/e2e_gate_chain" \
        2>&1 | grep "^|\|draft gate\|launched ahead\|gate's measured" ;;
    fold)  # the propose's attention with a KV head's query heads folded into its query rows (the default)
           # against one head at a time, each drafter, in one run
      timeout 300 python bench/drafter_profile.py --device cuda --batch-sizes 1,8,32 --calls 20 --warmup 6 --no-engine \
        --drafters smollm2-135m-dflash,smollm2-135m-dflash+unfolded,smollm2-135m-dspark,smollm2-135m-dspark+unfolded \
        --out "$OUT/fold" 2>&1 | grep "^|" ;;
    plain)  # what a drafter costs the plain regime a gate can settle in: every step plain and chained, at batch 32,
            # beside null and the gate itself, with the host's functions under cProfile (an untimed second pass)
      timeout 300 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 32 --drafters null,dflash+gate+plain,dflash+gate --skip-hf --cprofile 32 --gate-history \
        --out "$OUT/e2e_plain" 2>&1 | grep "^|\|draft gate\|launched ahead\|gate's measured" ;;
    depth)  # a deeper DFlash ($DEEP, default /tmp/ck-dflash: what `GROW=N ... train` left on this warm machine)
            # beside the shipped one: propose ms (compiled graphs) at batch 1, 8, 32, then e2e (the part `other`)
      deep=${DEEP:-/tmp/ck-dflash}
      [ -f "$deep/config.json" ] || { echo "depth: no checkpoint at $deep"; exit 1; }
      timeout 200 python bench/drafter_profile.py --device cuda --batch-sizes 1,8,32 --calls 20 --warmup 6 --no-engine \
        --drafters "smollm2-135m-dflash,$deep" --out "$OUT/depth" 2>&1 | grep "^| drafter\|^|---\|graph+compiled"
      OTHER="$deep" bash "$0" other ;;
    other)  # the shipped DFlash beside another DFlash checkpoint ($OTHER, a folder carried along), batch 1 and 32
      [ -n "${OTHER:-}" ] || { echo "other: set OTHER to a DFlash checkpoint folder"; exit 1; }
      timeout 400 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes "${BATCHES:-1,32}" --drafters "null,dflash,dflash@$OTHER" --skip-hf \
        --out "$OUT/e2e_other" 2>&1 | grep "^|" ;;
    gate)  # the draft gate (per batch size, the draft length measured fastest; the block drafters' default) beside
           # the same drafters without it (+nogate) and the suffix drafter with it (+gate)
      timeout 420 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --drafters null,suffix,suffix+gate,dflash+nogate,dflash,dspark+nogate,dspark --skip-hf \
        --out "$OUT/e2e_gate_humaneval" 2>&1 | grep "^|\|draft gate\|launched ahead" ;;
    gatesb)  # the same on Spec-Bench, 6 first turns per category (78)
      timeout 540 python bench/e2e.py --device cuda --dtype bfloat16 --spec-bench .evaldata/question.jsonl \
        --problems 0-5,10-15,20-25,30-35,40-45,50-55,60-65,70-75,80-85,160-165,240-245,320-325,400-405 \
        --max-new-tokens 256 --batch-sizes 1,8,32 --drafters null,suffix,suffix+gate,dflash+nogate,dflash --skip-hf \
        --out "$OUT/e2e_gate_specbench" 2>&1 | grep "^|\|draft gate" ;;
    gatecheck)  # the gate where it lost: Spec-Bench 0-79 at batch 1 (answers whose acceptance differs: DraftGate.joined)
                # and HumanEval 100-163 at batch 32, three runs (steps priced at the batch decided), here and in
                # BASE's tree (default .baseline, carried: a git archive of an earlier commit, as for ring)
      base=${BASE:-.baseline}
      sb1="bench/e2e.py --device cuda --dtype bfloat16 --spec-bench .evaldata/question.jsonl --problems 0-79
        --max-new-tokens 256 --skip-hf --batch-sizes 1 --gate-history"
      he32="bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 --skip-hf
        --batch-sizes 32 --repeat 3 --gate-history"
      timeout 150 python $sb1 --drafters null,dflash+nogate,dflash,dspark --out "$OUT/e2e_sb_b1" 2>&1 | grep "^| specdec"
      timeout 150 python $he32 --drafters null,dflash,dflash+gate+plain --out "$OUT/e2e_he_b32" 2>&1 | grep "^| specdec"
      mkdir -p "$base/specdec/drafters/checkpoints" "$base/.evaldata"
      ln -sfn "$PWD"/specdec/drafters/checkpoints/smollm2-135m-d* "$base/specdec/drafters/checkpoints/"
      cp .evaldata/question.jsonl "$base/.evaldata/"
      (cd "$base" && SPECDEC_CACHE=/tmp/basecache timeout 120 python $sb1 --drafters null,dflash,dspark \
        --out "$OUT/e2e_sb_b1_base" 2>&1 | grep "^| specdec"
       SPECDEC_CACHE=/tmp/basecache timeout 130 python $he32 --drafters null,dflash,dflash+gate+plain \
        --out "$OUT/e2e_he_b32_base" 2>&1 | grep "^| specdec") ;;
    gatesb32)  # the gate at batch 32 on Spec-Bench 0-239 (carried as .evaldata/question.jsonl): null, the plain regime
               # (DFlash behind a gate that never drafts: what its hooks cost), DFlash + gate, with an untimed
               # cProfile pass of each over its first $CPROFILE prompts (default 96: requests leaving and
               # joining, where the plain regime's host time goes); then DFlash + gate in
               # BASE's tree (default .baseline, carried: a git archive of an earlier commit, as for ring)
      base=${BASE:-.baseline}
      sb="bench/e2e.py --device cuda --dtype bfloat16 --spec-bench .evaldata/question.jsonl --problems 0-239
        --max-new-tokens 256 --skip-hf --batch-sizes 32 --gate-history"
      timeout 280 python $sb --drafters null,dflash+gate+plain,dflash+gate --cprofile ${CPROFILE:-96} --out "$OUT/e2e_sb_gate_b32" 2>&1 \
        | grep "^| specdec\|launched ahead"
      mkdir -p "$base/specdec/drafters/checkpoints" "$base/.evaldata"
      ln -sfn "$PWD/specdec/drafters/checkpoints/smollm2-135m-dflash" "$base/specdec/drafters/checkpoints/"
      cp .evaldata/question.jsonl "$base/.evaldata/"
      (cd "$base" && SPECDEC_CACHE=/tmp/basecache timeout 200 python $sb --drafters null,dflash+gate \
        --out "$OUT/e2e_sb_gate_base_b32" 2>&1 | grep "^| specdec\|launched ahead") ;;
    ring)  # the staging ring (a request's context positions wait for the propose that needs them): the GPU tests
           # of staged writes; e2e at batch 32 (null, DFlash, + gate, the plain regime: + gate + plain) in this tree
           # and in BASE's (default .baseline, made here and carried: git archive 601e80b specdec bench | tar -x
           # -C .baseline --exclude='specdec/drafters/checkpoints*' --exclude='bench/results/*'), then batch 1 here
      base=${BASE:-.baseline}
      timeout 120 python -m pytest tests/test_block_propose.py -m gpu -k "staged or stale" -p no:cacheprovider -rA \
        -o addopts= 2>&1 | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" | head -20 \
        | tee "$OUT/gpu_tests_ring.txt"
      e2e="bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 --skip-hf"
      timeout 200 python $e2e --batch-sizes 32 --drafters null,dflash+gate+plain,dflash+nogate,dflash+gate --gate-history \
        --out "$OUT/e2e_ring_b32" 2>&1 | grep "^| specdec\|launched ahead"
      mkdir -p "$base/specdec/drafters/checkpoints"
      ln -sfn "$PWD/specdec/drafters/checkpoints/smollm2-135m-dflash" "$base/specdec/drafters/checkpoints/"
      (cd "$base" && SPECDEC_CACHE=/tmp/basecache timeout 150 python $e2e --batch-sizes 32 \
        --drafters null,dflash+gate+plain,dflash+gate --gate-history --out "$OUT/e2e_ring_base_b32" 2>&1 | grep "^| specdec\|launched ahead")
      timeout 100 python $e2e --batch-sizes 1 --drafters null,dflash --out "$OUT/e2e_ring_b1" 2>&1 | grep "^| specdec" ;;
    gputests)  # GPU tests of the drafters, sampling and triton_mla's Helix path: one line per test in the file
      timeout 300 python -m pytest tests/test_block_propose.py tests/test_block_drafters.py tests/test_draft_gate.py tests/test_sampling_kernel.py \
        tests/test_sampling_batched.py tests/test_sampling_cutoffs.py tests/test_triton_mla.py -m gpu \
        -p no:cacheprovider -rA -o addopts= 2>&1 | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" \
        | head -120 | tee "$OUT/gpu_tests_drafters.txt" ;;
    devdrafts)
      timeout 120 python -m pytest tests/test_device_drafts.py -m gpu -p no:cacheprovider -rA -o addopts= 2>&1 \
        | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" | head -30 | tee "$OUT/gpu_tests_device_drafts.txt"
      timeout "${EVAL_TIMEOUT:-400}" python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 \
        --max-new-tokens 256 --batch-sizes "${BATCHES:-1,8}" --skip-hf --out "$OUT/e2e_device_drafts" \
        --drafters null,suffix,dflash,dflash+devdrafts,dspark,dspark+devdrafts,hybrid+dflash,hybrid+dflash+devdrafts \
        2>&1 | grep "^|\|^- " ;;
    trainsplit)  # where a training step's time goes on the GPU, what side by side saves, and the training loop's
                 # step with the plain and the compiled loss, by batch size
      sizes=${SPLIT_SEQS:-16 32 64}
      for seqs in $sizes; do  # the first size with a torch.profiler table of 3 steps (profile.txt)
        prof=""; [ "$seqs" = "${sizes%% *}" ] && prof="--profile"
        timeout 240 python bench/train_split.py --device cuda --seqs "$seqs" --steps 10 --out "$OUT/train_split_$seqs" \
          --data data/drafter-smollm2-135m-c --loop-steps "${LOOP:-20}" $prof 2>&1 | grep -v "^$\|USDT" | tail -9 \
          | tee -a "$OUT/train_split.txt"
      done ;;
    jointcheck)  # ms a training step: both kinds in one process against one process each, side by side (each
                 # planner times its steps while the other runs); 20 steps each, nothing kept
      sets="${DATA_SETS:-$(ls -d data/drafter-smollm2-135m*/ | tr '\n' ' ')}"
      common="--steps 20 --max-seconds 900 --seqs-per-step ${SEQS:-16} --val-every 0"
      timeout 200 python -m specdec.drafters.training --data $sets --kind dflash,dspark --out "/tmp/jc-{kind}" \
        --init "$CK/smollm2-135m-{kind}" $common 2>&1 | grep "time budget" | sed 's/^/one process, both: /' \
        | tee -a "$OUT/jointcheck.txt"
      for kind in dflash dspark; do
        timeout 200 python -m specdec.drafters.training --data $sets --kind $kind --out "/tmp/jc-$kind" \
          --init "$CK/smollm2-135m-$kind" $common 2>&1 | grep "time budget" | sed "s/^/$kind alone, beside the other: /" \
          > "/tmp/jc-$kind.txt" &
      done
      wait
      cat /tmp/jc-dflash.txt /tmp/jc-dspark.txt | tee -a "$OUT/jointcheck.txt" ;;
    hybrid)  # the shipped drafters beside both hybrids (DSpark's, DFlash's), batch 1 and 8: the learned
             # drafters' best chance against the suffix drafter (CPU tau 3.78 / 3.57 at batch 8 with round 10)
      timeout "${EVAL_TIMEOUT:-300}" python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 \
        --max-new-tokens 256 --batch-sizes "${BATCHES:-1,8}" --skip-hf --out "$OUT/e2e_hybrid" \
        --drafters null,suffix,dflash,hybrid,hybrid+dflash 2>&1 | grep "^|\|^- " ;;
    hostprofile)  # where a learned drafter's propose spends its host time: cProfile over 8 prompts at batch 1
      timeout "${EVAL_TIMEOUT:-300}" python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-131 \
        --max-new-tokens 256 --batch-sizes 1 --skip-hf --cprofile 8 --out "$OUT/e2e_hostprofile" \
        --drafters null,suffix,dflash,dspark,hybrid+dflash 2>&1 | grep "^|\|^- " ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
