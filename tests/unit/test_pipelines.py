"""Every pipeline compiles, and its IR says what Kubeflow Pipelines will run.

Checked on the compiled YAML (the file a user uploads): the components and their images, the
pipeline parameters with types and defaults, the ParallelFor over recipes and what is collected
from it, caching, and the Kubernetes platform spec of each step (GPUs, tolerations, the data
volume, ConfigMaps, Secrets as environment variables and never as parameters). Each embedded
component source is also loaded as the KFP executor loads it, so a body that needs a name from
its module (which KFP does not ship) fails here rather than in a pod.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from components.images import COMPONENT_IMAGE, RUNTIME_IMAGE
from pipelines import PIPELINE_NAMES, get_pipelines
from pipelines.cluster import (
    CLUSTER_WORK_DIR,
    DATA_MOUNT,
    DEFAULT_HF_SECRET,
    DEFAULT_MLFLOW_SECRET,
    DEFAULT_PVC,
    DEFAULT_RAYJOB_DEFAULTS,
    DEFAULT_RETRIES,
    GPU_RESOURCE,
    RAYJOB_DEFAULTS_MOUNT,
    RETRY_BACKOFF,
    RETRY_BACKOFF_MAX,
    STEP_SIZES,
)
from pipelines.compile import compile_all, main, pipeline_ir

EXECUTORS = {
    "fp8-rl": {"start-tracking", "prepare-model", "sft-warmup", "convert-to-fp8", "rl-step", "evaluate", "benchmark",
               "compare-recipes", "finish-tracking"},
    "recipe-comparison": {"start-tracking", "prepare-model", "sft-warmup", "convert-to-fp8", "diagnose-mismatch",
                          "comparison-runs", "rl-step", "evaluate", "benchmark", "compare-recipes", "finish-tracking"},
    "fp8-benchmark": {"start-tracking", "benchmark-recipes", "benchmark-model", "prepare-model", "convert-to-fp8",
                      "benchmark", "compare-recipes", "finish-tracking"},
}  # fmt: skip
GPU_STEPS = {"evaluate", "benchmark", "diagnose-mismatch"}
MEDIUM_STEPS = {"prepare-model", "sft-warmup", "convert-to-fp8", "rl-step"}
TRACKED_STEPS = {
    "start-tracking",
    "sft-warmup",
    "rl-step",
    "evaluate",
    "benchmark",
    "compare-recipes",
    "finish-tracking",
}
CLUSTER_PARAMS = {
    "pvc_name": DEFAULT_PVC,
    "rayjob_defaults": DEFAULT_RAYJOB_DEFAULTS,
    "mlflow_secret": DEFAULT_MLFLOW_SECRET,
    "hf_secret": DEFAULT_HF_SECRET,
}


@pytest.fixture(scope="module")
def irs() -> dict[str, list[dict[str, Any]]]:
    return {name: pipeline_ir(p) for name, p in get_pipelines().items()}


def executors(ir: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k.removeprefix("exec-"): v["container"] for k, v in ir[0]["deploymentSpec"]["executors"].items()}


def kube(ir: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    spec = ir[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return {k.removeprefix("exec-"): v for k, v in spec.items()}


def body(ir: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tasks inside the pipeline's exit handler: every step but the exit task."""
    return ir[0]["components"]["comp-exit-handler-1"]["dag"]["tasks"]


def all_tasks(ir: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    tasks = dict(ir[0]["root"]["dag"]["tasks"])
    for comp in ir[0]["components"].values():
        tasks.update(comp.get("dag", {}).get("tasks", {}))
    return tasks


def test_the_three_pipelines_are_registered() -> None:
    assert tuple(get_pipelines()) == PIPELINE_NAMES == ("fp8-rl", "recipe-comparison", "fp8-benchmark")


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_components_and_images(irs: dict[str, list[dict[str, Any]]], name: str) -> None:
    ir = irs[name]
    assert ir[0]["pipelineInfo"]["name"] == name
    execs = executors(ir)
    assert set(execs) == EXECUTORS[name]
    for step, container in execs.items():
        assert container["image"] == (RUNTIME_IMAGE if step in GPU_STEPS else COMPONENT_IMAGE), step
        # the images carry kfp and the project: no pip install when a pod starts
        assert "pip install" not in " ".join(container["command"]), step


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_embedded_component_sources_load_on_their_own(irs: dict[str, list[dict[str, Any]]], name: str) -> None:
    """What the KFP executor does with the shipped source: exec it alone; every default and annotation resolves."""
    for step, container in executors(irs[name]).items():
        module = types.ModuleType("ephemeral_component")
        exec(compile(container["command"][3], f"<{step}>", "exec"), module.__dict__)
        function = container["args"][container["args"].index("--function_to_execute") + 1]
        assert callable(getattr(module, function)), step


def _params(ir: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return ir[0]["root"]["inputDefinitions"]["parameters"]


def test_recipe_comparison_parameters(irs: dict[str, list[dict[str, Any]]]) -> None:
    params = _params(irs["recipe-comparison"])
    expected = {
        "recipes": ("LIST", ["bf16", "fp8-rollout", "fp8-e2e"]),
        "model_source": ("STRING", "tiny"),
        "seed": ("NUMBER_INTEGER", 0),
        "seeds": ("LIST", []),
        "sft_steps": ("NUMBER_INTEGER", 600),
        "rl_steps": ("NUMBER_INTEGER", 60),
        "bench_steps": ("NUMBER_INTEGER", 3),
        "run_config": ("STRUCT", {}),
        "convert_recipe": ("STRING", "fp8-e2e"),
        "experiment": ("STRING", "fp8rl"),
        "work_dir": ("STRING", CLUSTER_WORK_DIR),
        "backend": ("STRING", "rayjob"),
        "device": ("STRING", "auto"),
        **{k: ("STRING", v) for k, v in CLUSTER_PARAMS.items()},
        "diagnose": ("BOOLEAN", False),
        "diagnose_target": ("NUMBER_DOUBLE", 1.02),
    }
    assert {k: (v["parameterType"], v["defaultValue"]) for k, v in params.items()} == expected


def test_the_mismatch_diagnosis_runs_only_when_asked_on_the_warmed_up_model(
    irs: dict[str, list[dict[str, Any]]],
) -> None:
    ir = irs["recipe-comparison"]
    (cond,) = [t for name, t in body(ir).items() if name.startswith("condition-")]
    assert cond["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--diagnose'] == true"
    steps = ir[0]["components"][cond["componentRef"]["name"]]["dag"]["tasks"]
    diag = steps["diagnose-mismatch"]["inputs"]
    assert diag["artifacts"]["model"]["componentInputArtifact"].endswith("sft-warmup-model")
    assert diag["parameters"]["recipe"] == {"componentInputParameter": "pipelinechannel--convert_recipe"}
    assert diag["parameters"]["target"] == {"componentInputParameter": "pipelinechannel--diagnose_target"}


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_no_secret_travels_as_a_parameter(irs: dict[str, list[dict[str, Any]]], name: str) -> None:
    for pname in _params(irs[name]):
        assert not any(word in pname for word in ("token", "password", "credential")), pname
    secret_names = {v for k, v in CLUSTER_PARAMS.items() if k.endswith("_secret")}
    assert {_params(irs[name])[k]["defaultValue"] for k in ("mlflow_secret", "hf_secret")} == secret_names


def test_recipes_fan_out_and_are_collected(irs: dict[str, list[dict[str, Any]]]) -> None:
    ir = irs["recipe-comparison"]
    root = body(ir)
    (loop_name,) = [name for name in root if name.startswith("for-loop-")]
    loop = root[loop_name]
    # every recipe x seed, from the comparison-runs step's one output
    assert loop["parameterIterator"]["items"] == {"inputParameter": "pipelinechannel--comparison-runs-Output"}
    assert "iteratorPolicy" not in loop  # all recipes at once on a cluster
    steps = ir[0]["components"][loop["componentRef"]["name"]]["dag"]["tasks"]
    assert set(steps) == {"rl-step", "evaluate", "benchmark"}
    assert steps["evaluate"]["dependentTasks"] == ["rl-step"]
    assert sorted(steps["benchmark"]["dependentTasks"]) == ["evaluate", "rl-step"]
    item = "pipelinechannel--comparison-runs-Output-loop-item"
    for key in ("recipe", "seed"):
        assert steps["rl-step"]["inputs"]["parameters"][key] == {
            "componentInputParameter": item, "parameterExpressionSelector": f'parseJson(string_value)["{key}"]'
        }  # fmt: skip
    assert steps["rl-step"]["inputs"]["artifacts"]["model"]["componentInputArtifact"].endswith("sft-warmup-model")
    assert steps["evaluate"]["inputs"]["artifacts"]["model"]["taskOutputArtifact"]["producerTask"] == "rl-step"
    compare = root["compare-recipes"]["inputs"]
    assert compare["parameters"]["run_ids"]["taskOutputParameter"]["producerTask"] == loop_name
    assert compare["artifacts"]["conversion_report"]["taskOutputArtifact"]["producerTask"] == "convert-to-fp8"
    assert compare["parameters"]["kfp_run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_every_step_runs_inside_an_exit_handler_that_ends_the_mlflow_runs(
    irs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """However the run ends (a step failed, a pod killed outright), the exit task ends the run's MLflow runs that
    are still RUNNING; it finds them by the KFP run id, as KFP lets an exit task depend on no other task."""
    ir = irs[name]
    root = ir[0]["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "finish-tracking"}
    exit_task = root["finish-tracking"]
    assert exit_task["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}
    assert exit_task["dependentTasks"] == ["exit-handler-1"]
    inputs = exit_task["inputs"]["parameters"]
    assert inputs["status"] == {"taskFinalStatus": {"producerTask": "exit-handler-1"}}
    assert inputs["kfp_run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}
    assert inputs["experiment"] == {"componentInputParameter": "experiment"}
    assert {"start-tracking", "compare-recipes"} <= set(body(ir))
    assert "outputDefinitions" not in ir[0]["root"]  # KFP takes no pipeline output from inside an exit handler


def test_local_build_runs_one_recipe_at_a_time() -> None:
    ir = pipeline_ir(get_pipelines(parallelism=1)["recipe-comparison"])
    (loop,) = [t for name, t in body(ir).items() if name.startswith("for-loop-")]
    assert loop["iteratorPolicy"] == {"parallelismLimit": 1}


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_tracked_steps_are_never_cached(irs: dict[str, list[dict[str, Any]]], name: str) -> None:
    for task, spec in all_tasks(irs[name]).items():
        if task.startswith(("for-loop", "condition-", "exit-handler-")):
            continue
        assert spec.get("cachingOptions", {}).get("enableCache", False) is (task not in TRACKED_STEPS), task


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_kubernetes_platform_spec(irs: dict[str, list[dict[str, Any]]], name: str) -> None:
    ir = irs[name]
    spec, execs = kube(ir), executors(ir)
    assert set(spec) == set(execs)
    for step, k in spec.items():
        (mount,) = k["pvcMount"]
        assert mount["mountPath"] == DATA_MOUNT and mount["pvcNameParameter"]["componentInputParameter"].endswith(
            "pvc_name"
        )
        # the images' user, non-root (the chart's podSecurityContext): what KFP lets a step set
        assert k["securityContext"] == {"runAsUser": "1000", "runAsGroup": "1000", "runAsNonRoot": True}, step
        gpu = step in GPU_STEPS
        assert ("tolerations" in k) is gpu, step
        assert ("accelerator" in execs[step]["resources"]) is gpu, step
        if gpu:
            assert k["tolerations"] == [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
            accel = execs[step]["resources"]["accelerator"]
            assert (accel["resourceType"], accel["resourceCount"]) == (GPU_RESOURCE, "1")
        secrets = {e["envVar"]: s for s in k.get("secretAsEnv", []) for e in s["keyToEnv"]}
        if step in TRACKED_STEPS:
            assert set(secrets) == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
            (cm,) = k["configMapAsEnv"]
            assert cm["keyToEnv"] == [{"configMapKey": "mlflowTrackingUri", "envVar": "MLFLOW_TRACKING_URI"}]
            assert cm["optional"] is True
        elif step == "prepare-model":
            assert set(secrets) == {"HF_TOKEN"}
        else:
            assert not secrets and "configMapAsEnv" not in k
        for s in secrets.values():
            assert s["optional"] is True and s["secretNameParameter"]["componentInputParameter"].endswith("_secret")
        if step == "rl-step":
            (vol,) = k["configMapAsVolume"]
            assert vol["mountPath"] == RAYJOB_DEFAULTS_MOUNT
            assert vol["configMapNameParameter"]["componentInputParameter"].endswith("rayjob_defaults")
            # its pod's name and uid (downward API): the RayJob it submits is owned by the pod
            fields = {f["name"]: f["fieldPath"] for f in k["fieldPathAsEnv"]}
            assert fields == {"FP8RL_POD_NAME": "metadata.name", "FP8RL_POD_UID": "metadata.uid"}
        else:
            assert "configMapAsVolume" not in k and "fieldPathAsEnv" not in k


def test_rl_step_reads_the_mounted_template(irs: dict[str, list[dict[str, Any]]]) -> None:
    source = executors(irs["fp8-rl"])["rl-step"]["command"][3]
    assert f'rayjob_template: str = "{RAYJOB_DEFAULTS_MOUNT}/rayjob.yaml"' in source


def test_compile_cli_writes_one_file_per_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--output-dir", str(tmp_path), "--registry", "registry.example.com/ml/"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"{n}.yaml" for n in PIPELINE_NAMES)  # no temporary files left behind
    for name in PIPELINE_NAMES:
        docs = list(yaml.safe_load_all((tmp_path / f"{name}.yaml").read_text()))
        assert docs[0]["pipelineInfo"]["name"] == name and "platforms" in docs[1]
        images = {c["image"] for c in executors(docs).values()}
        assert images <= {f"registry.example.com/ml/{COMPONENT_IMAGE}", f"registry.example.com/ml/{RUNTIME_IMAGE}"}
    assert capsys.readouterr().out.count("wrote ") == 3


def test_compile_cli_refers_to_images_by_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digest = "sha256:" + "0123456789abcdef" * 4
    argv = ["--output-dir", str(tmp_path), "--registry", "r.example.com/ml", "--digest", f"fp8rl-runtime={digest}"]
    assert main([*argv, "fp8-benchmark"]) == 0
    images = {
        c["image"] for c in executors(list(yaml.safe_load_all((tmp_path / "fp8-benchmark.yaml").read_text()))).values()
    }
    assert images == {f"r.example.com/ml/fp8rl-runtime@{digest}", f"r.example.com/ml/{COMPONENT_IMAGE}"}
    for bad, why in (("fp8rl-gpu=" + digest, "must be one of"), ("fp8rl-runtime=sha256:ABC", "64 lowercase hex")):
        assert main(["--output-dir", str(tmp_path / "bad"), "--digest", bad]) == 2
        assert why in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_compile_cli_disable_caching_turns_off_every_steps_cache(tmp_path: Path) -> None:
    """``--disable-caching``: no task in any DAG of the file may be served from KFP's cache (a run from the UI runs
    every step); without it the steps that hold no MLflow run are cached."""

    def cached_tasks(path: Path) -> list[str]:
        spec = next(yaml.safe_load_all(path.read_text()))
        dags = [spec["root"], *spec.get("components", {}).values()]
        return [name for d in dags for name, t in d.get("dag", {}).get("tasks", {}).items()
                if t.get("cachingOptions", {}).get("enableCache", False)]  # fmt: skip

    assert main(["--output-dir", str(tmp_path / "on"), "recipe-comparison"]) == 0
    assert "prepare-model" in cached_tasks(tmp_path / "on" / "recipe-comparison.yaml")
    assert main(["--output-dir", str(tmp_path / "off"), "--disable-caching", "recipe-comparison"]) == 0
    assert cached_tasks(tmp_path / "off" / "recipe-comparison.yaml") == []


def test_compile_cli_default_dir_and_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["fp8-rl"]) == 0
    assert [p.name for p in (tmp_path / "dist" / "pipelines").iterdir()] == ["fp8-rl.yaml"]


def test_compile_cli_unknown_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--output-dir", str(tmp_path), "fp8-rl", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown pipeline(s) ['nope']" in err and "recipe-comparison" in err
    assert not list(tmp_path.iterdir())
    with pytest.raises(Exception, match="unknown"):
        compile_all(tmp_path, ["nope"])


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_every_step_has_cpu_and_memory_requests_and_a_retry(irs: dict[str, list[dict[str, Any]]], name: str) -> None:
    """The scheduler reserves what each kind of step needs, and a step whose pod failed (evicted, node lost) is
    retried with backoff; local builds retry nothing, so that an error shows at once."""
    ir = irs[name]
    for step, container in executors(ir).items():
        size = STEP_SIZES["gpu" if step in GPU_STEPS else "medium" if step in MEDIUM_STEPS else "small"]
        res = container["resources"]
        assert (res["resourceCpuRequest"], res["resourceMemoryRequest"]) == (size.cpu, size.memory), step
    steps = {t: spec for t, spec in all_tasks(ir).items() if t.replace("_", "-") in executors(ir)}
    assert set(steps) == set(executors(ir))
    for task, spec in steps.items():
        assert spec["retryPolicy"] == {
            "maxRetryCount": DEFAULT_RETRIES, "backoffDuration": RETRY_BACKOFF, "backoffFactor": 2.0,
            "backoffMaxDuration": RETRY_BACKOFF_MAX,
        }, task  # fmt: skip
    local = pipeline_ir(get_pipelines(parallelism=1, retries=0)[name])
    assert not any("retryPolicy" in spec for spec in all_tasks(local).values())


def test_step_requests_size_the_steps_that_hold_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--step-requests`` fits the medium steps to small nodes (a 2-core node cannot schedule the default 2 CPUs);
    the small and GPU steps keep theirs. A bad quantity is named and nothing is written."""
    assert main(["--output-dir", str(tmp_path), "--step-requests", "250m,1Gi", "fp8-rl"]) == 0
    ir = list(yaml.safe_load_all((tmp_path / "fp8-rl.yaml").read_text()))
    for step, container in executors(ir).items():
        res = container["resources"]
        want = ("250m", "1Gi") if step in MEDIUM_STEPS else (STEP_SIZES["small"].cpu, STEP_SIZES["small"].memory)
        if step not in GPU_STEPS:
            assert (res["resourceCpuRequest"], res["resourceMemoryRequest"]) == want, step
    assert {s for s in executors(ir) if s in MEDIUM_STEPS}
    for bad, message in (("2", "expected CPU,MEMORY"), ("2x,1Gi", "CPU '2x'"), ("1,8GB", "memory '8GB'")):
        assert main(["--output-dir", str(tmp_path / "bad"), "--step-requests", bad]) == 2
        err = capsys.readouterr().err
        assert f"--step-requests '{bad}': " in err and message in err, err
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_cpu_only_asks_for_no_gpu(name: str) -> None:
    """``--cpu-only`` (a cluster without GPUs): the GPU steps request no GPU, tolerate no GPU taint, run from the
    component image and reserve the medium size; every other step is as compiled for GPUs."""
    ir = pipeline_ir(get_pipelines(gpus=False)[name], cpu_only=True)
    text = yaml.safe_dump_all(ir)
    assert RUNTIME_IMAGE not in text and "nvidia.com/gpu" not in text and "accelerator" not in text
    medium = STEP_SIZES["medium"]
    gpu_steps = set(executors(ir)) & GPU_STEPS
    assert gpu_steps
    for step in gpu_steps:
        res = executors(ir)[step]["resources"]
        assert executors(ir)[step]["image"] == COMPONENT_IMAGE
        assert (res["resourceCpuRequest"], res["resourceMemoryRequest"]) == (medium.cpu, medium.memory), step
    full = pipeline_ir(get_pipelines()[name])
    for step in set(executors(ir)) - GPU_STEPS:
        assert executors(ir)[step] == executors(full)[step], step


def test_compile_cli_writes_every_component_for_reuse(tmp_path: Path) -> None:
    """``--components``: each component's YAML, loadable by kfp and usable in a pipeline of one's own."""
    from kfp import compiler, dsl
    from kfp.components import load_component_from_file

    assert main(["fp8-rl", "--output-dir", str(tmp_path), "--components", "--registry", "reg.example/ml"]) == 0
    written = sorted(p.stem for p in (tmp_path / "components").glob("*.yaml"))
    assert written == sorted(set().union(*EXECUTORS.values()))  # every component of every pipeline
    prepare = load_component_from_file(str(tmp_path / "components" / "prepare-model.yaml"))
    convert = load_component_from_file(str(tmp_path / "components" / "convert-to-fp8.yaml"))

    @dsl.pipeline(name="mine")
    def mine():  # type: ignore[no-untyped-def]  # KFP reads real annotations; this module's are strings
        model = prepare(source="tiny", seed=3)
        convert(model=model.outputs["model"], recipe="fp8-e2e")

    compiler.Compiler().compile(mine, str(tmp_path / "mine.yaml"))
    (spec,) = [d for d in yaml.safe_load_all((tmp_path / "mine.yaml").read_text()) if d]
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {f"reg.example/ml/{COMPONENT_IMAGE}"}
