"""The actors of one RL step seen from the driver: every wait bounded and named (``ActorCalls``), the rollout
workers as one engine (``RolloutGroup``) and the trainer ranks as one trainer (``TrainerGroup``), and how an actor
fails (``WorkerError``, ``WorkerDied``, ``WorkerTimeout``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8rl.errors import UserError
from fp8rl.rollout.base import Rollout, SamplingParams
from fp8rl.train.old_logprobs import MAXIMA, PolicyStep
from fp8rl.train.step_profile import METRIC_PREFIX as TRAIN_MS
from fp8rl.train.trainer import SequenceBatch


class WorkerError(RuntimeError):
    """An actor raised; the message names the actor and the call, the original is chained."""


class WorkerDied(RuntimeError):
    """An actor is gone (killed, out of memory, node lost); the driver may replace it and resume."""


class WorkerTimeout(UserError):
    """An actor did not answer within ``RayConfig.actor_timeout_s``."""


@dataclass
class ActorCalls:
    """Waits on actor calls with a deadline, translating Ray's failures into ours."""

    timeout_s: float

    def get(self, refs: Any, what: str | Sequence[str]) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise WorkerTimeout(f"{_names(what)} did not answer within {self.timeout_s:g}s") from None
        except RayActorError as e:
            raise WorkerDied(f"{_names(what)}: actor died{_node_of(e)}: {e}") from e
        except RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            raise WorkerError(f"{_names(what)} raised {type(cause).__name__}: {cause}") from cause


def _names(what: str | Sequence[str]) -> str:
    return what if isinstance(what, str) else ", ".join(what)


def _node_of(error: Exception) -> str:
    """`` on <host> (<ip>)`` for the Ray node the dead actor ran on, from the IP in Ray's message; on Kubernetes the
    host name is the Ray pod's name, so the message names the pod that went away. Empty when unknown."""
    import re

    import ray

    found = re.search(r"\bip: (\d+\.\d+\.\d+\.\d+)", str(error))
    if not found:
        return ""
    try:
        nodes = ray.nodes()
    except Exception:  # the GCS itself is gone: the IP is all there is to say
        return f" on {found.group(1)}"
    hosts = {n.get("NodeManagerAddress"): n.get("NodeManagerHostname") for n in nodes}
    host = hosts.get(found.group(1))
    return f" on {host} ({found.group(1)})" if host else f" on {found.group(1)}"


def _row_chunks(n: int, parts: int) -> list[slice]:
    """Contiguous, near-equal row ranges (the first ones one longer), empty ones dropped."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        if size:
            out.append(slice(start, start + size))
        start += size
    return out


def _cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several workers' rollouts of consecutive prompt chunks (responses right-padded)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.response_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Rollout(
        prompt_ids=[ids for p in parts for ids in p.prompt_ids],
        response_ids=torch.cat([pad(p.response_ids, pad_id) for p in parts]),
        response_mask=torch.cat([pad(p.response_mask, 0.0) for p in parts]),
        logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
        finished=torch.cat([p.finished for p in parts]),
        policy_version=min(p.policy_version for p in parts),
    )


def _engine_answers(answers: list[Rollout], tp: int, names: list[str]) -> list[Rollout]:
    """One rollout per engine from its ``tp`` workers' answers, which must agree token for token (they sampled the
    same logits with the same seeds; a difference means the ranks fell out of step)."""
    out = []
    for g in range(0, len(answers), tp):
        first = answers[g]
        for other, name in zip(answers[g + 1 : g + tp], names[g + 1 : g + tp], strict=True):
            if not torch.equal(other.response_ids, first.response_ids):
                raise WorkerError(
                    f"{name} sampled other tokens than {names[g]}, the first worker of its tensor-parallel engine"
                )
        out.append(first)
    return out


@dataclass
class RolloutGroup:
    """The rollout workers behind the ``RolloutEngine`` methods the loop uses."""

    actors: list[Any]
    calls: ActorCalls
    colocated: bool
    pad_token_id: int
    policy_version: int = 0
    names: list[str] = field(default_factory=list)
    # colocated vLLM engines: the device memory their last sleep freed, summed over the workers
    sleep_freed_bytes: int | None = None
    # rollout.tensor_parallel_size: consecutive workers in groups of tp are one engine
    tp: int = 1

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Rollout:
        self.wake_up()
        engines = len(self.actors) // self.tp
        chunks = _row_chunks(len(prompt_ids), engines)
        refs, names = [], []
        for i, rows in enumerate(chunks):
            # each engine samples its chunk with a seed of its own, fixed by the chunk's position; every worker of a
            # tensor-parallel engine runs the same requests (vLLM's external_launcher: they step in lockstep)
            params = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + 7919 * i})
            for j in range(i * self.tp, (i + 1) * self.tp):
                actor, name = self.actors[j], self.names[j] if j < len(self.names) else f"rollout-{j}"
                refs.append(actor.generate.remote(prompt_ids[rows], params))
                names.append(name)
        answers = self.calls.get(refs, [f"{n}.generate" for n in names])
        self.sleep()
        return _cat_rollouts(_engine_answers(answers, self.tp, names), self.pad_token_id)

    def wake_up(self) -> None:
        """Colocated engines take their device memory back (generation, weight loads); no-op when split."""
        if self.colocated:
            self.calls.get([a.wake_up.remote() for a in self.actors], self.names)

    def sleep(self) -> None:
        """Colocated engines give their device memory to training; no-op when split."""
        if self.colocated:
            freed = self.calls.get([a.sleep.remote() for a in self.actors], self.names)
            measured = [f for f in freed if f is not None]
            self.sleep_freed_bytes = sum(measured) if measured else None


# policy_step metrics that are each rank's own (not its share of a global sum): the group reports the largest
PER_RANK_MAX = ("optimizer_offload_s", "cuda_alloc_retries")
PROFILE, NCCL = "profile/", TRAIN_MS + "nccl"  # a profiled step's metrics (fp8rl.train.step_profile)


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One policy step's metrics from its ranks': each rank's loss and metrics are its exact share of the global
    ones (summed); the grad norm and lr are global (rank 0's); a rank's own costs (``PER_RANK_MAX``), paid by
    all ranks at once, are the slowest rank's; a profiled step's numbers are one rank's (below)."""
    shared = [{k: v for k, v in m.items() if not k.startswith(PROFILE)} for m in per_rank]
    keys = dict.fromkeys(k for m in shared for k in m)  # every rank's (a rank whose rows were all masked has fewer)
    out = {k: sum(m.get(k, 0.0) for m in shared) for k in keys}
    for global_key in ("grad_norm", "lr"):
        out[global_key] = per_rank[0][global_key]
    for key in PER_RANK_MAX:
        if key in out:
            out[key] = max(m.get(key, 0.0) for m in per_rank)
    # a profiled step (fp8rl.train.step_profile): one rank's profile whole, the busiest's (most non-NCCL kernel time)
    profiled = [m for m in per_rank if any(k.startswith(PROFILE) for k in m)]
    if profiled:
        busiest = max(profiled, key=lambda m: sum(v for k, v in m.items() if k.startswith(TRAIN_MS) and k != NCCL))
        out.update({k: v for k, v in busiest.items() if k.startswith(PROFILE)})
    return out


@dataclass
class TrainerGroup:
    """The data-parallel trainer workers behind the trainer methods the loop uses."""

    actors: list[Any]
    calls: ActorCalls
    names: list[str] = field(default_factory=list)
    # fsdp: every rank takes part in every forward and in every gather of the full weights
    sharded: bool = False
    # called before the trainer state is gathered (colocated engines kept awake after a sync: put them to sleep)
    before_full_state: Callable[[], None] | None = None

    def _lead(self, method: str, call: Callable[[Any], Any]) -> Any:
        """``call(actor)`` (one remote call of ``method``) on rank 0, whose answer counts; sharded, on every rank (a
        collective), rank 0 answering."""
        if not self.sharded:
            return self.calls.get(call(self.actors[0]), f"{self.names[0]}.{method}")
        return self.calls.get([call(a) for a in self.actors], [f"{n}.{method}" for n in self.names])[0]

    def kv_scales(self, batch: SequenceBatch) -> tuple[Any, float]:
        """The FP8 KV cache's scales from the policy's activations on ``batch``, and the seconds it took."""
        scales, seconds = self._lead("kv_scales", lambda a: a.kv_scales.remote(batch))
        return scales, float(seconds)

    def save_policy(self, output_dir: str, model_dir: str) -> None:
        self._lead("save_policy", lambda a: a.save_policy.remote(output_dir, model_dir))

    def compute_logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        chunks = _row_chunks(batch.input_ids.shape[0], len(self.actors))
        if self.sharded:  # a rank with no rows still joins the forwards' all-gathers
            n = batch.input_ids.shape[0]
            chunks += [slice(n, n)] * (len(self.actors) - len(chunks))
        refs = [
            a.compute_logprobs.remote(batch.slice(rows), temperature)
            for a, rows in zip(self.actors, chunks, strict=False)
        ]
        return torch.cat(self.calls.get(refs, [f"{n}.compute_logprobs" for n in self.names[: len(refs)]]))

    def policy_step(self, step: PolicyStep) -> dict[str, float]:
        """Each rank steps on its rows with the whole batch's totals; the ranks' metrics are their shares of the
        batch's (``combine_rank_metrics``), the maxima among them (a train-forward step's mismatch and correction
        maxima, ``fp8rl.train.old_logprobs``) the largest."""
        # every rank takes part in the gradient all-reduce, so every rank gets rows
        chunks = _row_chunks(step.batch.input_ids.shape[0], len(self.actors))
        if len(chunks) < len(self.actors):
            n = step.batch.input_ids.shape[0]
            raise ValueError(f"a batch of {n} rows cannot feed {len(self.actors)} trainer ranks")
        refs = [a.policy_step.remote(step.rows(rows)) for a, rows in zip(self.actors, chunks, strict=True)]
        per_rank: list[dict[str, float]] = self.calls.get(refs, [f"{n}.policy_step" for n in self.names])
        out = combine_rank_metrics(per_rank)
        for key in MAXIMA:
            if key in out:
                out[key] = max(m.get(key, 0.0) for m in per_rank)
        return out

    def profile_next_policy_step(self) -> None:
        """Every rank profiles its next policy step (the group reports one rank's: ``combine_rank_metrics``)."""
        self.calls.get([a.profile_next_policy_step.remote() for a in self.actors], self.names)

    def state_dict(self) -> dict[str, Any]:
        if self.before_full_state is not None:
            self.before_full_state()
        state: dict[str, Any] = self._lead("state_dict", lambda a: a.state_dict.remote())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        ref = ray.put(state)
        self.calls.get([a.load_state_dict.remote(ref) for a in self.actors], self.names)
