#!/usr/bin/env bash
# On the GPU machine (after the stage-for-device.sh stashes): GPU tests and the end-to-end tables.
#   bash bench/device_gpu.sh tests     # GPU tests of graphs, fused kernels, triton_gqa
#   bash bench/device_gpu.sh realtests # only the real-model GPU tests
#   bash bench/device_gpu.sh specdec   # specdec null/suffix at batch 1, 8, 32 (INVARIANT=1: + batch-invariant runs)
#   bash bench/device_gpu.sh hf        # HF generate baselines (batch 1 on 100-107: HF is slow there)
#   bash bench/device_gpu.sh hfstatic  # HF generate with a static cache (batch 1, 100-103)
#   bash bench/device_gpu.sh block     # the block drafters at batch 8 and 32
#   bash bench/device_gpu.sh mla       # triton_mla: config sweep, then the 720-shape grid
#   bash bench/device_gpu.sh profile   # step_profile (fused vs fused-GEMM step) and drafter_profile (block propose)
#   bash bench/device_gpu.sh vprofile  # step_profile: a 16-token verify replay beside a decode replay, kernel by kernel
#   bash bench/device_gpu.sh tuned     # the suffix drafter with longer drafts (k = 15: 16-token verify rows), without
#                                      # and with a dev-split corpus, batch 1 and 8, REPEAT (3) rounds
#   bash bench/device_gpu.sh host      # host time per step and the PDL levels, in turn (random weights)
#   bash bench/device_gpu.sh prompts   # prompt steps from graphs (default) against eager ones (tuned suffix drafter, batch 1)
#   bash bench/device_gpu.sh overlap   # overlapped decode steps (default for null) against plain ones (host profile, e2e)
#   bash bench/device_gpu.sh newtests  # only the GPU tests of overlapped steps, prompt graphs, PDL and the real model
#   bash bench/device_gpu.sh pgoverlap # batch 1, tuned suffix drafter: prompt graphs and overlapped steps on and off,
#                                      # in one run (REPEAT rounds, default 2; CPROFILE=N: + a cProfile of each
#                                      # system over N prompts, untimed)
#   bash bench/device_gpu.sh core      # GPU tests of the engine core, then e2e null/suffix/dflash/dspark at batch 1, 8, 32
#   bash bench/device_gpu.sh compile   # block drafters' propose compiled (torch_compile=True) against plain: the
#                                      # compiled GPU tests, then drafter_profile
#   bash bench/device_gpu.sh hybrid    # e2e at batch 1, 8, 32: null, suffix, dflash, dspark, hybrid, each block drafter
#                                      # compiled (the default on CUDA) and not (a call of its own: up to 9 minutes)
#   bash bench/device_gpu.sh nullafter # null at batch 8 after a compiled drafter in the same process, with inductor's
#                                      # compile workers and without (TORCHINDUCTOR_COMPILE_THREADS=1), then alone
#   bash bench/device_gpu.sh cute      # cute_mla's GPU tests, then its columns beside triton_mla (wheels staged first)
#   bash bench/device_gpu.sh cutemerge # cute_mla's fused split merge: its GPU tests, then bench/cute_host.py
#   bash bench/device_gpu.sh helix     # bench/helix.py with cp = 1 (one GPU)
#   bash bench/device_gpu.sh sampling  # greedy, half-sampled and all-sampled batches of 32 Spec-Bench prompts, null and
#                                      # suffix: step time vs all-greedy, greedy rows and seeded rows equal (REPEAT:
#                                      # rounds, default 1; IGNORE_EOS=1: every request runs to max-new-tokens, so
#                                      # every mix keeps all 32 requests in each step while its requests last).
#                                      # Needs .evaldata/question.jsonl (git-ignored evaluation
#                                      # data): name .evaldata in the call's carry
#   bash bench/device_gpu.sh cutoffs   # the sort-free top-k / top-p cutoff kernel: its GPU tests (every path, vocab
#                                      # 49152), then its settings swept on real logits (cutoff_sweep)
#   bash bench/device_gpu.sh sampprofile # sampling_profile: sample_rows part by part (the cutoff kernel beside the
#                                      # sort), end to end (needs .evaldata carried); then 'sampling' for the table
#   bash bench/device_gpu.sh nullcompile # null at batch 8 before and after a compiled DSpark in one process: timers,
#                                      # GC time, cProfile and process state (then with the drafter released)
#   bash bench/device_gpu.sh hybridcost # e2e at batch 1, 8, 32: null, suffix, dspark, hybrid (cost-aware, the
#                                      # default), hybrid+nocost, hybrid+dflash
#   bash bench/device_gpu.sh serve     # bench/serve.py: DRAFTERS (default null,suffix,dflash) at concurrency 1-64
#                                      # and two rates
#                                      # (stage fastapi, starlette, uvicorn, pydantic, pydantic-core,
#                                      # annotated-types, typing-inspection, opentelemetry-api, anyio and
#                                      # typing-extensions as stage-for-device.sh extras, at pyproject's
#                                      # versions; carry .evaldata)
#   bash bench/device_gpu.sh vllm      # issue 20's peer: vLLM 0.26.0's server (no speculation, n-gram) under
#                                      # serve's loads (PEERS), after installing its wheels from /tmp/vparts
#                                      # (parts staged one call each first; carry .evaldata)
#   bash bench/device_gpu.sh versus    # e2e null/suffix in another tree beside this one, interleaved: batch
#                                      # 1, 8, 32 once, then batch 32 with --repeat 5, twice. BASE names the
#                                      # tree (default .baseline), made here and carried, e.g.
#                                      # mkdir .baseline && git archive 6ba7073 specdec bench/e2e.py
#                                      # bench/results_io.py | tar -x -C .baseline
#                                      # --exclude='specdec/drafters/checkpoints*'
set -uo pipefail
. /tmp/stage/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
for part in "$@"; do
  case "$part" in
    tests)
      timeout 300 python -m pytest tests/test_cuda_graphs.py tests/test_target_kernels.py tests/test_triton_gqa.py \
        tests/test_block_propose.py tests/test_pdl.py tests/test_overlap.py -k "TestOnGPU or TestSmolLM2OnGPU or kernels or graph_plan or fixed_offset or gpu or ptx" \
        -p no:cacheprovider -rs -o addopts= 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
      timeout 200 python -m pytest tests/test_triton_mla.py -m gpu -p no:cacheprovider -rs -x \
        2>&1 | tail -15 | tee "$OUT/gpu_tests_mla.txt" ;;
    newtests)
      timeout 260 python -m pytest tests/test_overlap.py tests/test_cuda_graphs.py tests/test_pdl.py \
        -k "GPU" -p no:cacheprovider -rA -o addopts= > "$OUT/gpu_tests_new.txt" 2>&1
      grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E  |passed|failed" "$OUT/gpu_tests_new.txt" | head -40 ;;
    pgoverlap)
      timeout 330 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1 --repeat "${REPEAT:-2}" --k 15 --suffix-kwargs '{"match_len_factor": 16}' \
        --drafters null+nooverlap+nopg,null+nooverlap,null+nopg,null,suffix+corpus+nopg,suffix+corpus \
        --suffix-corpus bench/results/smollm2_fp32_humaneval_0-99.json --skip-hf ${CPROFILE:+--cprofile $CPROFILE} \
        --out "$OUT/e2e_pgoverlap" 2>&1 \
        | grep "^|" ;;
    sampling)  # sampled and greedy requests in one batch (issue 16's acceptance); .evaldata must be carried
      timeout 220 python bench/sampling_mix.py --spec-bench .evaldata/question.jsonl --batch-size 32 --num-prompts 32 \
        --max-new-tokens 256 --device cuda --dtype bfloat16 ${REPEAT:+--repeat $REPEAT} ${IGNORE_EOS:+--ignore-eos} \
        --out "$OUT/sampling_mix${IGNORE_EOS:+_ignore_eos}" 2>&1 \
        | grep -E "^\||^\`|Error|error" ;;
    realtests)  # the real model on the GPU only (strict lossless in fp32, bf16 batch-invariant)
      timeout 300 python -m pytest tests/test_cuda_graphs.py -k TestSmolLM2OnGPU -p no:cacheprovider -rs -o addopts= \
        2>&1 | tail -8 | tee "$OUT/gpu_tests_real.txt" ;;
    specdec)
      timeout 330 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --drafters null,suffix ${INVARIANT:+--invariant} --skip-hf --out "$OUT/e2e_specdec" 2>&1 \
        | tail -40 ;;
    hf)  # 2026-12-03: with --hf-static in the same run this passed 330 s and printed nothing
      timeout 560 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --hf-problems 100-107 \
        --max-new-tokens 256 --batch-sizes 1,8,32 --drafters null --out "$OUT/e2e_hf" 2>&1 | tail -40 ;;
    hfstatic)  # HF with a static (compiled) cache, batch 1 on four prompts, beside HF greedy and specdec null
      timeout 560 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-103 --max-new-tokens 256 \
        --batch-sizes 1 --drafters null --hf-static --out "$OUT/e2e_hfstatic" 2>&1 | tail -20 ;;
    block)
      timeout 200 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 8,32 --drafters null,dflash,dspark --skip-hf --out "$OUT/e2e_block" 2>&1 | tail -30 ;;
    vprofile)  # a 16-token verify replay beside a decode replay, the default path, every kernel of each
      timeout 200 python bench/step_profile.py --device cuda --modes gemm_pdl2 --batch-sizes 1,8 --verify-rows 16 \
        --out "$OUT/vprof" 2>&1 | grep -E "^\{|^\*\*" | head -12 ;;
    profile)
      timeout 150 python bench/step_profile.py --device cuda --out "$OUT/prof" 2>&1 | grep "^|" | head -9
      timeout 240 python bench/drafter_profile.py --device cuda --out "$OUT/drafter" 2>&1 | tail -20 ;;
    tuned)
      timeout 560 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8 --repeat "${REPEAT:-3}" --drafters null,suffix,suffix+corpus --k 15 --suffix-kwargs '{"match_len_factor": 16}' \
        --suffix-corpus bench/results/smollm2_fp32_humaneval_0-99.json --skip-hf --out "$OUT/e2e_tuned" 2>&1 | tail -30 ;;
    overlap)  # overlapped decode steps (EngineConfig.overlap_steps) beside plain ones: random weights, then the real model
      timeout 150 python bench/host_profile.py --device cuda --overlap 0,1,0,1 --batch-sizes 1,32 --new-tokens 128 \
        --out "$OUT/host_overlap" 2>&1 | grep "^|" | head -10
      timeout 400 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --repeat 2 --drafters null+nooverlap,null --skip-hf --out "$OUT/e2e_overlap" 2>&1 | tail -20 ;;
    prompts)  # prompt steps replayed from graphs (the default) beside eager ones, batch 1, one run
      timeout 280 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1 --repeat 2 --drafters null,null+nopg,suffix+corpus,suffix+corpus+nopg --k 15 \
        --suffix-kwargs '{"match_len_factor": 16}' --suffix-corpus bench/results/smollm2_fp32_humaneval_0-99.json \
        --skip-hf --out "$OUT/e2e_prompts" 2>&1 | grep "^|" ;;
    host)
      timeout 120 python bench/host_profile.py --device cuda --pdl 2,1,0,2,1 --batch-sizes 1 --new-tokens 128 \
        --out "$OUT/host" 2>&1 | grep "^|" | head -8
      timeout 120 python bench/host_profile.py --device cuda --batch-sizes 1,32 --cprofile --eager-prompts --out "$OUT/host_cprofile" \
        2>&1 | grep "^|" | head -4 ;;
    core)  # the engine core after its restructuring: GPU tests of graphs, overlap and the real model, then
           # outputs equal to null and tokens/s at batch 1, 8, 32 (compare with BENCHMARKS.md's end-to-end table)
      timeout 240 python -m pytest tests/test_cuda_graphs.py tests/test_overlap.py tests/test_block_propose.py \
        tests/test_pdl.py tests/test_target_kernels.py -m gpu -p no:cacheprovider -rA -o addopts= > "$OUT/gpu_tests_core.txt" 2>&1
      grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests_core.txt" | head -30
      timeout 330 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --drafters null,suffix,dflash,dspark --skip-hf --out "$OUT/e2e_core" 2>&1 | grep "^|" ;;
    compile)  # the compiled propose: equal drafts inside graphs, its cost per propose, then end to end
      timeout 200 python -m pytest tests/test_block_propose.py -m gpu -k "compiled or lossless" -p no:cacheprovider \
        -rA -o addopts= > "$OUT/gpu_tests_compile.txt" 2>&1
      grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests_compile.txt" | head -20
      timeout 300 python bench/drafter_profile.py --device cuda --batch-sizes 1,8,32 --calls 30 --warmup 6 \
        --engine-paths new,new+compiled --out "$OUT/drafter_compile" 2>&1 | grep "^|" ;;
    hybrid)  # end to end (one call of its own): the compiled propose and the hybrid drafter beside null and suffix
      timeout 560 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --drafters null,suffix,dflash+nocompile,dflash,dspark+nocompile,dspark,hybrid+nocompile,hybrid \
        --skip-hf --out "$OUT/e2e_hybrid" 2>&1 | grep "^|\|^- " ;;
    cutoffs)  # issue 16: the cutoffs without a sort: GPU tests, then its settings on real logits (a call of its own)
      timeout 200 python -m pytest tests/test_sampling_kernel.py tests/test_sampling_cutoffs.py -p no:cacheprovider -rA \
        -o addopts= > "$OUT/gpu_tests_cutoffs.txt" 2>&1
      grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gpu_tests_cutoffs.txt" | head -30
      timeout 150 python bench/cutoff_sweep.py --device cuda --out "$OUT/cutoff_sweep" 2>&1 | grep "^|" | head -40 ;;
    sampprofile)  # sample_rows part by part (the cutoff kernel beside the sort) and end to end
      timeout 300 python bench/sampling_profile.py --device cuda --spec-bench .evaldata/question.jsonl \
        --out "$OUT/sampling_profile" 2>&1 | grep "^|" | head -40 ;;
    nullcompile)  # issue 17: where the host time of null after a compiled drafter goes
      timeout 200 python bench/null_after_compile.py --device cuda --out "$OUT/null_after_compile" 2>&1 | grep "^|"
      timeout 200 python bench/null_after_compile.py --device cuda --release --out "$OUT/null_after_compile_released" \
        2>&1 | grep "^|" ;;
    hybridcost)  # issue 15: the cost-aware hybrid beside the plain one
      timeout 560 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 1,8,32 --drafters null,suffix,dspark,hybrid,hybrid+nocost,hybrid+dflash --skip-hf --out "$OUT/e2e_hybrid_cost" \
        2>&1 | grep "^|\|^- " ;;
    nullafter)  # 2026-12-05: null at batch 8 ran 35-40 % slower (host launch time) after a compiled drafter
      for threads in "" 1; do
        echo "TORCHINDUCTOR_COMPILE_THREADS=${threads:-default}"
        env ${threads:+TORCHINDUCTOR_COMPILE_THREADS=$threads} timeout 150 python bench/e2e.py --device cuda --dtype bfloat16 \
          --problems 100-163 --max-new-tokens 256 --batch-sizes 1,8 --drafters dspark,null --skip-hf \
          --out "$OUT/e2e_nullafter_${threads:-default}" 2>&1 | grep "^| specdec"
      done
      timeout 100 python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \
        --batch-sizes 8 --drafters null --skip-hf --out "$OUT/e2e_null_alone" 2>&1 | grep "^| specdec" ;;
    cute)  # the CuTe DSL MLA kernel (needs the nvidia-cutlass-dsl wheels staged: see cute_mla's docstring),
           # then its columns beside triton_mla on the quick grid
      # a missing or broken package would skip every GPU test: say so and stop instead
      python -c "import sys; from specdec.attention.backends import cute_mla as c; e = c.IMPORT_ERROR; \
print('cute_mla import:', e or 'ok'); sys.exit(1 if e else 0)" || exit 1
      for group in "not fp8 and not helix" "fp8 and not helix" "helix"; do  # each its own log and limit
        name=$(echo "$group" | tr -c 'a-z0-9\n' '_')
        timeout "${CUTE_TEST_S:-150}" python -m pytest -m gpu tests/test_cute_mla.py -k "$group" -x -rs --durations=10 \
          -q -p no:cacheprovider -o addopts= > "$OUT/gpu_tests_cute_$name.txt" 2>&1
        echo "== $group: exit $?"; tail -6 "$OUT/gpu_tests_cute_$name.txt"
      done
      timeout 120 python bench/mla_decode.py --quick --backends torch_ref,triton_mla,cute_mla --out "$OUT/mla_cute" \
        2>&1 | tail -30 ;;
    cutemerge)  # issue 19: cute_mla's split merge in one launch (the default) on the GPU: its tests (triton_mla's
                # merge kernel on cute's partials; the fused path beside the bit-exact one), then the host cost a call
      python -c "import sys; from specdec.attention.backends import cute_mla as c; e = c.IMPORT_ERROR; \
print('cute_mla import:', e or 'ok'); sys.exit(1 if e else 0)" || exit 1
      timeout 200 python -m pytest -m gpu tests/test_triton_mla.py tests/test_cute_mla.py -k "merge or prepared_launch" \
        -rs -q -p no:cacheprovider -o addopts= > "$OUT/gpu_tests_cute_merge.txt" 2>&1
      echo "== merge tests: exit $?"; tail -6 "$OUT/gpu_tests_cute_merge.txt"
      timeout 200 python bench/cute_host.py --out "$OUT/cute_host" 2>&1 | tail -12 ;;
    helix)  # Helix attention against context, cp = 1 on one GPU (cp = 2, 4 need a machine with several GPUs)
      timeout 300 torchrun --standalone --nproc-per-node 1 bench/helix.py --device cuda --out "$OUT/helix" 2>&1 \
        | grep -E "^\||Error" ;;
    serve)  # issue 20's load bench (about 500 s for three drafters)
      timeout 570 python bench/serve.py --device cuda --dtype bfloat16 --target smollm2-135m \
        --questions .evaldata/question.jsonl --drafters "${DRAFTERS:-null,suffix,dflash}" --concurrency 1,8,32,64 \
        --rates 2,8 --max-requests 80 --max-tokens 256 --max-num-seqs 64 --out "$OUT/serve_gpu" 2>&1 | tail -25 ;;
    servecache)  # issue 20: the null server under the same loads twice, first over an empty Triton cache, then
                 # over the one the first left: the Triton kernels each load built, by function (serve.md's notes),
                 # tell first-time compiles the warm-up missed from ones a warm on-disk cache hides (~2 x 150 s)
      export TRITON_CACHE_DIR="$(mktemp -d)"
      for pass in cold warm; do
        timeout 280 python bench/serve.py --device cuda --dtype bfloat16 --target smollm2-135m \
          --questions .evaldata/question.jsonl --drafters "${DRAFTERS:-null}" --concurrency 1,8,32,64 --rates "" \
          --max-requests 80 --max-tokens 256 --max-num-seqs 64 --out "$OUT/serve_$pass" 2>&1 | grep -v "it/s\]$" | tail -14
      done ;;
    vllm)  # issue 20's peer. The wheels (vLLM 0.26.0's closure for torch 2.11, plus numpy 2.3 for numba and
           # mistral-common) are made by ../shared/tools/vllm-closure/closure.py, tarred and split into ~60 MB
           # parts, each staged by its own call into /tmp/vparts
      if [ ! -d /tmp/vsite/vllm ]; then
        mkdir -p /tmp/vwhl && cat /tmp/vparts/part.* | tar -C /tmp/vwhl -xf - \
          && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite /tmp/vwhl/*.whl \
          && printf 'import site as _s\n_s.addsitedir("/tmp/vsite")\n' > /tmp/vsite/sitecustomize.py \
          || { echo "vllm: the wheels did not install"; exit 1; }
      fi
      python -c "from specdec.target import load_target; load_target('smollm2-135m')" >/dev/null  # its HF folder
      PYTHONPATH="/tmp/vsite:$PYTHONPATH" timeout 570 python bench/serve.py --device cuda --dtype bfloat16 \
        --target smollm2-135m --questions .evaldata/question.jsonl --drafters "${PEERS:-vllm-ngram,vllm}" \
        --concurrency 1,8,32,64 --rates 2,8 --max-requests 80 --max-tokens 256 --max-num-seqs 64 \
        --out "$OUT/serve_vllm" 2>&1 | tail -25 ;;
    versus)  # issue 17's bar: today's tree against BASE's, same machine, interleaved (about 370 s; the six
             # tables come back as $OUT/versus/*.md)
      base=${BASE:-.baseline}
      mkdir -p "$OUT/versus"
      e2e="bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 --skip-hf"
      for round in ${ROUNDS:-0 1 2}; do
        sizes="--batch-sizes 32 --repeat 5"; limit=80
        [ "$round" = 0 ] && sizes="--batch-sizes 1,8,32" && limit=120
        # EXTRA: more of today's systems in the batch-32 rounds, e.g. suffix+nofreeze
        extra=""; [ "$round" != 0 ] && [ -n "${EXTRA:-}" ] && extra=",$EXTRA" && limit=$((limit + 50))
        timeout $limit python $e2e --drafters null,suffix$extra $sizes --out "$OUT/versus/today_$round" 2>&1 \
          | grep "^| specdec\|garbage collector"
        # the e2e script puts its own tree first on sys.path, so BASE's specdec is the one imported there
        (cd "$base" && SPECDEC_CACHE=/tmp/basecache timeout 120 python $e2e --drafters null,suffix $sizes \
          --out "$OUT/versus/base_$round" \
          2>&1 | grep "^| specdec")
      done
      rm -f "$OUT"/versus/*.json ;;  # at most 8 files come back
    mla)
      timeout 420 python bench/mla_decode.py --sweep --full --sweep-budget-s "${MLA_SWEEP_S:-90}" \
        --budget-s "${MLA_GRID_S:-240}" --out "$OUT/mla" 2>&1 | tail -60 ;;
  esac
done
