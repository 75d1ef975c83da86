"""The plan as a job for the cluster engines teams already run: a Kubeflow Trainer TrainJob for
Kubernetes, a SkyPilot task and a dstack task.

Each runs the plan's own launch command, unchanged (so every flag the plan adds reaches the
cluster too), once per node, after two steps: a check that the engine gave the nodes and GPUs the
plan's accelerate config was written for, and the engine's node variables mapped onto the two the
command reads, NODE_RANK and MASTER_ADDR. Checkpoints go to storage every node mounts, and
`--resume auto` makes a job the engine restarts continue from its newest checkpoint.

Pure functions of the plan, as files.py; each file is checked in the tests by its engine's own
library (tests/plan/test_cluster_files.py).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

import yaml

from finetune.plan import gpus
from finetune.plan.choose import Plan
from finetune.plan.gpus import GPUSpec
from finetune.plan.workload import Workload

TRAINJOB_FILE = "trainjob.yaml"
SKYPILOT_FILE = "skypilot.yaml"
DSTACK_FILE = "dstack.yaml"
CHECKPOINTS = "/checkpoints"  # where every node mounts the shared checkpoint storage
# Kubernetes: Kubeflow Trainer's PyTorch runtime (it sets the PET_* variables below); the image must
# hold finetune; the claim is a ReadWriteMany volume the user creates once
TRAINER_RUNTIME = "torch-distributed"
IMAGE = "ghcr.io/YOUR-ORG/finetune:latest"
CHECKPOINT_CLAIM = "finetune-checkpoints"
WORKDIR = "/workspace"  # the container's working directory: the launch command reads its files from here
# dstack: a filesystem mounted at the same path on every host of the fleet (EFS, FSx, NFS...)
DSTACK_HOST_CHECKPOINTS = "/mnt/checkpoints"
# the catalog's GPU names as the engines spell them where they differ (SkyPilot: the plain A100 and
# V100 are the 40 GB and 16 GB ones; dstack: gpuhunt's names, with the memory where one name has two sizes)
SKYPILOT_GPUS = {"A100-40GB": "A100", "H100-80GB": "H100", "V100-16GB": "V100", "RTX-A6000": "A6000"}
DSTACK_GPUS = {"A100-40GB": "A100:40GB", "A100-80GB": "A100:80GB", "H100-80GB": "H100", "V100-16GB": "V100:16GB",
               "V100-32GB": "V100:32GB", "RTX6000-Ada": "RTX6000Ada", "H100-NVL": "H100NVL", "RTX-A6000": "A6000",
               "RTX-PRO-6000": "RTXPRO6000"}
# catalog cards gpuhunt does not list: dstack asks for them by their memory, as for a card given by its memory
DSTACK_BY_MEMORY = ("H20",)


@dataclass(frozen=True)
class NodeVariables:
    """How an engine tells each node of a job who it is, as shell expressions and variables."""

    engine: str
    node_rank: str  # this node's rank, 0 for the node that hosts the rendezvous
    master_addr: str  # the address of node 0
    nodes: str  # variable holding the number of nodes
    gpus_per_node: str | None = None  # variable holding the GPUs of each node, where the engine sets one


SKYPILOT = NodeVariables("SkyPilot", '"$SKYPILOT_NODE_RANK"', '"$(echo "$SKYPILOT_NODE_IPS" | head -n1)"',
                         "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE")
DSTACK = NodeVariables("dstack", '"$DSTACK_NODE_RANK"', '"$DSTACK_MASTER_NODE_IP"', "DSTACK_NODES_NUM", "DSTACK_GPUS_PER_NODE")
# Kubeflow Trainer's torch plugin: PET_NPROC_PER_NODE may read "auto", so only the node count is checked
KUBEFLOW = NodeVariables("Kubeflow Trainer", '"$PET_NODE_RANK"', '"$PET_MASTER_ADDR"', "PET_NNODES")


def job_name(w: Workload) -> str:
    """`finetune-<model>-<method>` as a DNS label (lowercase letters, digits, dashes; ≤ 63), the
    strictest of the three engines' name rules."""
    label = re.sub(r"[^a-z0-9]+", "-", f"finetune-{w.model.name}-{w.method}".lower()).strip("-")
    return label[:63].rstrip("-")


def node_script(plan: Plan, config_dir: str, launch: str, engine: NodeVariables) -> str:
    """The shell lines each node runs: check the engine's counts against the plan, map its node
    variables, then the plan's launch command with the checkpoint directory and `--resume auto`."""
    w = plan.workload
    expected = [(engine.nodes, w.nodes)] + ([(engine.gpus_per_node, w.gpus_per_node)] if engine.gpus_per_node else [])
    checks = [f'[ "${{{name}:-}}" = {value} ] || {{ echo "finetune: {engine.engine} set {name}=${{{name}:-}}, but this '
              f'plan ({config_dir}/) is for {w.nodes} node(s) x {w.gpus_per_node} GPU(s): write its files for this '
              f'cluster with finetune plan --nodes N --gpus GxTYPE --write-config {config_dir}" >&2; exit 1; }}'
              for name, value in expected]
    output_dir = posixpath.join(CHECKPOINTS, job_name(w))
    return "\n".join([
        "set -euo pipefail",
        *checks,
        f"export NODE_RANK={engine.node_rank}",
        f"export MASTER_ADDR={engine.master_addr}",
        f"{launch} --output-dir {shlex.quote(output_dir)} --resume auto",
        "",
    ])


def trainjob(plan: Plan, config_dir: str, launch: str, launch_files: dict[str, str]) -> list[dict]:
    """A ConfigMap holding the plan's launch files, and the Kubeflow Trainer TrainJob that mounts it
    where the launch command reads it, with the checkpoint claim at CHECKPOINTS on every node."""
    w = plan.workload
    name = job_name(w)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-plan"}, "data": launch_files}
    pod = {
        "volumes": [{"name": "plan", "configMap": {"name": f"{name}-plan"}},
                    {"name": "checkpoints", "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}}],
        "containers": [{"name": "node", "volumeMounts": [
            {"name": "plan", "mountPath": posixpath.join(WORKDIR, config_dir)},
            {"name": "checkpoints", "mountPath": CHECKPOINTS}]}],
    }
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": TRAINER_RUNTIME},
            "trainer": {
                "image": IMAGE,
                "numNodes": w.nodes,
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(w.gpus_per_node)}},
                "command": ["bash", "-c", f"cd {WORKDIR}\n{node_script(plan, config_dir, launch, KUBEFLOW)}"],
            },
            "runtimePatches": [{"manager": "finetune", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}],
        },
    }
    return [config_map, job]


def skypilot_task(plan: Plan, config_dir: str, launch: str) -> dict:
    """A SkyPilot task: the GPUs per node and nodes of the plan, finetune installed from the synced
    working directory (the clone `sky launch` runs from), a bucket mounted for checkpoints."""
    w = plan.workload
    return {
        "name": job_name(w),
        "resources": skypilot_accelerators(w),
        "num_nodes": w.nodes,
        "workdir": ".",
        "file_mounts": {CHECKPOINTS: {"name": f"{job_name(w)}-checkpoints", "mode": "MOUNT"}},
        "setup": f"pip install -e .{install_extras(w)}\n",
        "run": node_script(plan, config_dir, launch, SKYPILOT),
    }


def dstack_task(plan: Plan, config_dir: str, launch: str) -> dict:
    """A dstack task: `nodes` and the GPUs per node of the plan, the repository the configuration
    sits in, and checkpoints on a filesystem every host mounts."""
    w = plan.workload
    return {
        "type": "task",
        "name": job_name(w),
        "nodes": w.nodes,
        "python": "3.12",
        "repos": [{"local_path": repo_path(config_dir), "path": "."}],
        "volumes": [{"instance_path": DSTACK_HOST_CHECKPOINTS, "path": CHECKPOINTS}],
        "commands": [f"pip install -e .{install_extras(w)}", node_script(plan, config_dir, launch, DSTACK)],
        "resources": {"gpu": f"{dstack_gpu(w.gpu)}:{w.gpus_per_node}", "shm_size": "16GB"},
    }


def skypilot_accelerators(w: Workload) -> dict:
    """SkyPilot's accelerators for the plan's GPUs; a card given by its memory (`--gpus 2x48GB`) as any of
    the catalog's cards of that size, since SkyPilot names accelerators, not memory sizes."""
    if not w.gpu.speed_of:
        return {"accelerators": f"{SKYPILOT_GPUS.get(w.gpu.name, w.gpu.name)}:{w.gpus_per_node}"}
    return {"any_of": [{"accelerators": f"{SKYPILOT_GPUS.get(name, name)}:{w.gpus_per_node}"}
                       for name in gpus.at_least(w.gpu.memory_gib)]}


def dstack_gpu(gpu: GPUSpec) -> str:
    """dstack's name for the card (gpuhunt's), or its memory where gpuhunt has no name for it."""
    if gpu.speed_of or gpu.name in DSTACK_BY_MEMORY:
        return f"{gpu.memory_gib:g}GB"
    return DSTACK_GPUS.get(gpu.name, gpu.name)


def install_extras(w: Workload) -> str:
    return "[deepspeed]" if w.deepspeed else ""


def repo_path(config_dir: str) -> str:
    """The directory `finetune plan` ran in, relative to `config_dir`, where the file is read from
    (dstack resolves a repo's local_path against the configuration file's folder)."""
    depth = len([part for part in posixpath.normpath(config_dir).split("/") if part not in ("", ".")])
    return posixpath.join(*[".."] * depth) if depth and not posixpath.isabs(config_dir) else "."


def cluster_texts(plan: Plan, config_dir: str, launch_files: dict[str, str], launch: str) -> dict[str, str]:
    """File name → text of the three cluster jobs, for the plan's files saved in `config_dir`
    (`launch_files`: the accelerate YAML and DeepSpeed JSON, which the TrainJob carries in a
    ConfigMap; `launch`: the plan's launch command, run on every node)."""
    where = {TRAINJOB_FILE: f"kubectl apply -f {config_dir}/{TRAINJOB_FILE}. Needs Kubeflow Trainer (its {TRAINER_RUNTIME} "
                            f"runtime), an image with finetune installed in place of {IMAGE}, and a ReadWriteMany "
                            f"PersistentVolumeClaim named {CHECKPOINT_CLAIM} (mounted at {CHECKPOINTS}).",
             SKYPILOT_FILE: f"sky launch {config_dir}/{SKYPILOT_FILE}, from the finetune clone (the synced workdir). "
                            f"Checkpoints go to a bucket mounted at {CHECKPOINTS}.",
             DSTACK_FILE: f"dstack apply -f {config_dir}/{DSTACK_FILE}. Checkpoints go to {CHECKPOINTS}: a filesystem "
                          f"every host of the fleet mounts at {DSTACK_HOST_CHECKPOINTS}."}
    documents = {TRAINJOB_FILE: trainjob(plan, config_dir, launch, launch_files),
                 SKYPILOT_FILE: [skypilot_task(plan, config_dir, launch)],
                 DSTACK_FILE: [dstack_task(plan, config_dir, launch)]}
    return {name: f"# Written by `finetune plan --write-config {config_dir}`: {where[name]}\n"
                  + yaml.dump_all(documents[name], Dumper=BlockStrings, sort_keys=False, allow_unicode=True)
            for name in documents}


# libyaml's emitter where PyYAML was built with it: the page writes these files for every plan it
# shows, and the pure-Python emitter was most of its answer time (bench/plan_page.py)
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class BlockStrings(SAFE_DUMPER):
    """YAML with multi-line strings (scripts, the files a ConfigMap holds) as `|` blocks, readable."""


BlockStrings.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))
