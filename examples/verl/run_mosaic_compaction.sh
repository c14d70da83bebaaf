#!/usr/bin/env bash
# Mosaic on verl 0.9.1: GRPO-style training on the deep-search world under compaction, with the Mosaic
# estimator (session-aware trajectory advantage + session gains), trajectory-token-mean aggregation,
# through verl's own trainer (`verl.trainer.main_ppo`, v1: Ray, TransferQueue, the `mosaic_agent` loop,
# FSDP actor, rollout servers).
#
# DEVICE=gpu (default): a CUDA node with 1-8 GPUs, vLLM rollouts. Needs `pip install "mosaic-rl[verl]"`
#   plus verl's GPU stack (`pip install "verl[vllm]==0.9.1"`) and MODEL, a local model directory with a
#   ChatML template (SmolLM2-135M-Instruct, Qwen2.5-0.5B-Instruct). Not yet run on a GPU here:
#   examples/verl/gpu_check.sh is the prepared check for a lent accelerator.
# DEVICE=cpu: the same trainer on CPU (mosaic.integrations.verl.cpu: a CPU platform for verl, its FSDP
#   engine on gloo, an HF rollout server with weight sync), small batches, the shipped model by default,
#   one optimizer step per step; the rollout must stay `hf` (vLLM/SGLang need a GPU).
#   Tested: tests/integrations/verl/test_cpu_e2e.py (`make slow`), 2 steps of this script and its twin.
#
# Usage: [DEVICE=cpu] [MODEL=/path] [NGPU=1] [STEPS=2] examples/verl/run_mosaic_compaction.sh [Hydra overrides]
set -euo pipefail

DEVICE=${DEVICE:-gpu}
NGPU=${NGPU:-1}
STEPS=${STEPS:-2}
DATA=${DATA:-$PWD/runs/verl-data}
ESTIMATOR=${ESTIMATOR:-mosaic}          # mosaic | mosaic-traj | mosaic-session | broadcast (mosaic.core.estimators names)
GAINS=${GAINS:-true}                    # score session gains on the rollout servers (mosaic, mosaic_session)
NAME=${NAME:-$ESTIMATOR-compaction}
PYTHON=${PYTHON:-python}

case "$DEVICE" in
  gpu)
    MODEL=${MODEL:?set MODEL to a local model directory (SmolLM2-135M-Instruct or a Qwen 0.5B-class instruct model)}
    # Several optimizer steps per step (verl's mini-batch is ppo_mini_batch_size x n rows, one row per
    # session): verl weighs each mini-batch's tokens by N / N_minibatch (docs/verl.md; metric mosaic/verl_minibatches).
    DEVICE_ARGS=(
      data.train_batch_size="${BATCH:-16}" data.max_prompt_length=2048 data.max_response_length=2048
      actor_rollout_ref.model.use_remove_padding=True
      actor_rollout_ref.actor.optim.lr=1e-6
      actor_rollout_ref.actor.ppo_mini_batch_size="${BATCH:-16}" actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
      actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n="${N:-8}"
      actor_rollout_ref.rollout.gpu_memory_utilization=0.5
      actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
      actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
      +mosaic.harness.context_budget=1024 +mosaic.harness.max_new_tokens=128 +mosaic.harness.summary_max_new_tokens=160
      +mosaic.harness.max_turns=12 +mosaic.harness.max_sessions=12 +mosaic.harness.max_total_turns=48
      trainer.logger="${LOGGER:-[console,tensorboard]}"
    ) ;;
  cpu)
    MODEL=${MODEL:-$("$PYTHON" -c "from mosaic.train.setup import base_model_dir; print(base_model_dir('tiny'))")}
    export VERL_PLATFORM=cpu          # the Mosaic plugin registers verl's CPU support in every process
    export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # One optimizer step per step, as in `mosaic train`: a mini-batch of MINIBATCH x N rows holds every
    # session row of a step (at most BATCH x N x max_sessions), which verl allows with dynamic batch sizes.
    DEVICE_ARGS=(
      trainer.device=cpu actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2
      +actor_rollout_ref.model.override_config.attn_implementation=sdpa
      actor_rollout_ref.model.use_remove_padding=False
      data.train_batch_size="${BATCH:-2}" data.max_prompt_length=1024 data.max_response_length=1024
      data.dataloader_num_workers=0
      actor_rollout_ref.actor.optim.lr=1e-4
      actor_rollout_ref.actor.ppo_mini_batch_size="${MINIBATCH:-$(( ${BATCH:-2} * 4 ))}"
      actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192
      actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.n="${N:-2}" actor_rollout_ref.rollout.free_cache_engine=False
      actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192
      actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192
      actor_rollout_ref.rollout.agent.num_workers=1
      +mosaic.harness.context_budget=512 +mosaic.harness.max_new_tokens=64 +mosaic.harness.summary_max_new_tokens=64
      +mosaic.harness.max_turns=6 +mosaic.harness.max_sessions=4 +mosaic.harness.max_total_turns=12
      +ray_kwargs.ray_init.num_gpus="$NGPU" ray_kwargs.ray_init.num_cpus=16   # logical worker slots, no GPU
      trainer.logger="${LOGGER:-[console,file]}"      # file: JSON lines at $VERL_FILE_LOGGER_PATH
    ) ;;
  *) echo "DEVICE must be gpu or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac
[ -f "$MODEL/config.json" ] || { echo "MODEL=$MODEL is not a model directory (no config.json)" >&2; exit 2; }
if [ "$DEVICE" = cpu ]; then
  for arg in "$@"; do
    case "$arg" in
      actor_rollout_ref.rollout.name=hf) ;;
      actor_rollout_ref.rollout.name=*) echo "DEVICE=cpu serves rollouts with 'hf' ($arg needs a GPU)" >&2; exit 2 ;;
    esac
  done
fi

# 1. the deep-search splits as verl Parquet (rows name the `mosaic_agent` loop and carry their world)
mkdir -p "$DATA"
[ -f "$DATA/train.parquet" ] || mosaic data export --split train --preset cpu --out "$DATA/train.parquet"
[ -f "$DATA/validation.parquet" ] || mosaic data export --split validation --preset cpu --out "$DATA/validation.parquet"
REWARD=$("$PYTHON" -c "import mosaic.integrations.verl.reward as m; print(m.__file__)")

# 2. verl's PPO entry point; `import verl` loads the Mosaic plugin (entry point `verl.plugins: mosaic`)
#    in the driver and every Ray worker: estimators, advantage-row hook, `mosaic_agent` loop.
"$PYTHON" -m verl.trainer.main_ppo \
    trainer.use_v1=True \
    algorithm.adv_estimator="$ESTIMATOR" \
    algorithm.use_kl_in_reward=False \
    +algorithm.mosaic.rho=0.2 +algorithm.mosaic.delta=0.1 +algorithm.mosaic.lam=0.1 \
    +algorithm.mosaic.loss_agg=trajectory-token-mean \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/validation.parquet" \
    data.return_raw_chat=True data.filter_overlong_prompts=False \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.agent.default_agent_loop=mosaic_agent \
    reward.custom_reward_function.path="$REWARD" reward.custom_reward_function.name=compute_score \
    +mosaic.gains="$GAINS" +mosaic.harness.mode=compaction \
    trainer.n_gpus_per_node="$NGPU" trainer.nnodes=1 \
    trainer.total_training_steps="$STEPS" trainer.total_epochs=1 \
    trainer.save_freq=-1 trainer.test_freq=-1 trainer.val_before_train=False \
    trainer.project_name=mosaic trainer.experiment_name="$NAME" \
    "${DEVICE_ARGS[@]}" \
    "$@"
