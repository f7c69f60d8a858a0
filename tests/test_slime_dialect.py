"""slime's dialect of SGLang against the real server on 127.0.0.1 (CPU, gloo): a trainer process joins the weight
update group at rank 0 and broadcasts every tensor in `names` order while this process drives the HTTP calls as
slime does (pause -> flush -> init_weights_update_group -> update_weights_from_distributed -> continue). Then
greedy /generate equals a fresh engine on the new weights and reports the new weight_version. A push with one
wrong shape, and one whose sender dies mid-broadcast, are refused within the group timeout (+ slack); weights,
version and serving stay. The sparse patch push over the same group, and the other control endpoints' shapes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from safetensors.torch import load_file, save_file  # noqa: E402

from conftest import perturbed_checkpoint  # noqa: E402
from server_harness import LiveServer  # noqa: E402

from rollout import AsyncEngine, Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.server_config import ServerConfig  # noqa: E402
from trainer_bridge import toy_task  # noqa: E402

PROMPT = "12+34="
GROUP_TIMEOUT_S = 5  # the server's weight_group_timeout_s in these tests
REFUSED_WITHIN_S = GROUP_TIMEOUT_S + 10  # a broken push must be answered by then
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
ROOT = Path(__file__).resolve().parent.parent

# rank 0 of the weight update group, as slime's trainer: joins, then for each plan line on stdin broadcasts the
# named tensors of a safetensors file in order (dying after `die_after` of them if asked), and says "done"
TRAINER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from safetensors.torch import load_file
from weight_updates.transports.sglang_dist import init_custom_process_group
init_method, group_name, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
group = init_custom_process_group(backend="gloo", init_method=init_method, world_size=2, rank=0,
                                  group_name=group_name, timeout=timedelta(seconds=timeout_s))
print("joined", flush=True)
for line in sys.stdin:
    plan = json.loads(line)
    tensors = load_file(plan["path"])
    for i, key in enumerate(plan["order"]):
        if plan.get("die_after") == i:
            os._exit(3)
        dist.broadcast(tensors[key].contiguous(), src=0, group=group)
    print("done", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return toy_task.write_model(tmp_path_factory.mktemp("slime_toy"), hidden_size=32, num_layers=2, seed=4)


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", deterministic=True, max_num_seqs=16, num_kv_blocks=64)


def greedy_ids(path) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return Engine(config(path)).generate([PROMPT], params)[0].outputs[0].token_ids


class Trainer:
    """The trainer process at rank 0 of a group the server joins through /init_weights_update_group."""

    def __init__(self, client, tmp_path: Path, group_name: str) -> None:
        self.client, self.tmp_path, self.group_name = client, tmp_path, group_name
        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, f"tcp://127.0.0.1:{port}", group_name, str(GROUP_TIMEOUT_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        r = client.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert self.proc.stdout.readline().strip() == "joined"

    def push(self, tensors: dict[str, torch.Tensor], order: list[str], body: dict, die_after: int | None = None):
        """POST /update_weights_from_distributed with `body` while the trainer broadcasts `tensors` in `order`."""
        path = self.tmp_path / f"push-{time.monotonic_ns()}.safetensors"
        save_file({k: t.contiguous() for k, t in tensors.items()}, path)
        self.proc.stdin.write(json.dumps({"path": str(path), "order": order, "die_after": die_after}) + "\n")
        self.proc.stdin.flush()
        return self.client.post("/update_weights_from_distributed", json={"group_name": self.group_name, **body})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def dense_body(tensors: dict[str, torch.Tensor], version: str) -> dict:
    return {"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "weight_version": version, "flush_cache": True}


def generate(client) -> dict:
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_slime_distributed_push_and_the_refused_ones(model_dir, tmp_path):
    moved = perturbed_checkpoint(model_dir, tmp_path / "moved", seed=1)
    new = load_file(moved / "model.safetensors")
    expected, original = greedy_ids(moved), greedy_ids(model_dir)
    assert expected != original  # the push must be visible
    srv = LiveServer(AsyncEngine(config(model_dir)), ServerConfig(weight_group_timeout_s=GROUP_TIMEOUT_S))
    with srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        # slime's sampling_params as it sends them (GenerateState), with a sampling_seed
        r = client.post("/generate", json={"input_ids": [3, 4, 5], "return_logprob": True, "sampling_params": {
            "temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 4, "stop": None, "stop_token_ids": None,
            "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
            "custom_params": {"return_top_p_token_ids": True}, "sampling_seed": 11}})
        meta = r.json()["meta_info"]
        assert r.status_code == 200 and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(
            meta["output_token_logprobs"]) and meta["cached_tokens"] == 0 and meta["weight_version"] == "0"
        before = generate(client)
        assert before["output_ids"] == original and before["meta_info"]["weight_version"] == "0"
        # slime's sequence; a /generate sent while paused waits for continue_generation
        assert client.post("/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
        assert client.get("/flush_cache").status_code == 200
        waiting: dict = {}
        sender = threading.Thread(target=lambda: waiting.setdefault("r", generate(client)))
        sender.start()
        trainer = Trainer(client, tmp_path, "slime_group")
        names = list(new)  # the checkpoint's order; every tensor the engine holds
        # as slime sends it: buckets, each its own call with the same weight_version, staged until continue
        half = len(names) // 2
        for bucket in (names[:half], names[half:]):
            tensors = {n: new[n] for n in bucket}
            r = trainer.push(tensors, bucket, dense_body(tensors, "7"))
            assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "7", r.text
            assert trainer.proc.stdout.readline().strip() == "done"
        assert sender.is_alive()  # still paused
        r = client.post("/continue_generation").json()
        assert r["status"] == "ok" and r["weight_update"]["success"], r
        assert r["weight_update"]["weight_version"] == "7" and r["weight_update"]["num_dense"] == len(names)
        sender.join(30)
        after = generate(client)
        for result in (waiting["r"], after):
            assert result["output_ids"] == expected and result["meta_info"]["weight_version"] == "7"
            assert result["meta_info"]["finish_reason"]["type"] == "length"
            assert [e[1] for e in result["meta_info"]["output_token_logprobs"]] == expected
        assert client.get("/get_weight_version").json() == {"weight_version": "7"}

        # one wrong shape: every tensor is still received (the trainer finishes), nothing is written
        wrong = dict(new)
        wrong["model.norm.weight"] = torch.zeros(new["model.norm.weight"].numel() + 1)
        started = time.monotonic()
        r = trainer.push(wrong, names, dense_body(wrong, "8"))
        assert r.status_code == 400 and "model.norm.weight" in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < REFUSED_WITHIN_S
        assert trainer.proc.stdout.readline().strip() == "done"
        # an unknown name and a wrong dtype, each refused the same way
        for bad, needle in (({**new, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, "model.layers.9"),
                            ({**new, "model.norm.weight": new["model.norm.weight"].bfloat16()}, "model.norm.weight"),
                            ({**new, "model.norm.weight": new["model.norm.weight"].double()}, "model.norm.weight")):
            r = trainer.push(bad, list(bad), dense_body(bad, "8"))
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
            assert trainer.proc.stdout.readline().strip() == "done"
        assert generate(client)["output_ids"] == expected
        assert client.get("/get_weight_version").json() == {"weight_version": "7"}

        # paused, a wrong shape in the second bucket refuses the whole update: the first bucket is not written
        client.post("/pause_generation", json={})
        first = {n: torch.zeros_like(new[n]) for n in names[:half]}
        r = trainer.push(first, names[:half], dense_body(first, "8"))
        assert r.status_code == 200 and trainer.proc.stdout.readline().strip() == "done"
        second = {**{n: new[n] for n in names[half:]}, "model.norm.weight": torch.zeros(3)}
        r = trainer.push(second, list(second), dense_body(second, "8"))
        assert r.status_code == 400 and "model.norm.weight" in r.json()["error"]["message"], r.text
        assert trainer.proc.stdout.readline().strip() == "done"
        r = client.post("/continue_generation").json()
        assert r["status"] == "ok" and not r["weight_update"]["success"] and "model.norm.weight" in r["weight_update"]["error"]
        assert generate(client)["output_ids"] == expected
        assert client.get("/get_weight_version").json() == {"weight_version": "7"}

        # paused (slime's flow), the sender dies after half the tensors: refused within the timeout, the group is gone
        client.post("/pause_generation", json={})
        started = time.monotonic()
        r = trainer.push(load_file(model_dir / "model.safetensors"), names, dense_body(new, "9"),
                         die_after=len(names) // 2)
        assert r.status_code == 400 and "broke off" in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < REFUSED_WITHIN_S
        assert trainer.proc.wait(30) == 3
        r = client.post("/continue_generation").json()
        assert not r["weight_update"]["success"] and "broke off" in r["weight_update"]["error"], r
        result = generate(client)
        assert result["output_ids"] == expected and result["meta_info"]["weight_version"] == "7"
        info = client.get("/get_server_info").json()
        assert info["weight_version"] == "7" and info["weight_update_groups"] == []
        r = client.post("/update_weights_from_distributed", json={"group_name": "slime_group", **dense_body(new, "9")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "group_name"

        # the sparse patch push over a new group: ~1% of one tensor's elements change
        from weight_updates import WeightDiffer
        from weight_updates.wire import plan_bucket, write_bucket

        specs = srv.engine.engine.weight_specs()
        differ = WeightDiffer(specs)
        differ.commit(differ.encode(new))
        patched = {k: t.clone() for k, t in new.items()}
        w = patched["model.layers.0.mlp.up_proj.weight"].view(-1)
        w[:: max(1, w.numel() // 50)] += 1.0
        push = differ.encode(patched)
        changed = [u for u in push.updates if u.nbytes and u.name == "model.layers.0.mlp.up_proj.weight"]
        assert len(changed) == 1 and changed[0].nbytes < w.numel() * w.element_size() // 10
        plan = plan_bucket(changed)
        bucket = torch.empty(plan.nbytes, dtype=torch.uint8)
        write_bucket(plan, bucket)
        trainer2 = Trainer(client, tmp_path, "patch_group")
        r = trainer2.push({"bucket0": bucket}, ["bucket0"], {
            "encoding": "patch", "names": [changed[0].name], "weight_version": "8",
            "buckets": [{"header": plan.header, "nbytes": plan.nbytes}]})
        assert r.status_code == 200 and r.json()["num_patch"] == 1, r.text
        assert trainer2.proc.stdout.readline().strip() == "done"
        assert torch.equal(srv.engine.engine.runner.weights.view(changed[0].name), w.view_as(new[changed[0].name]))
        assert client.post("/destroy_weights_update_group", json={"group_name": "patch_group"}).json()["success"]
        trainer2.close()
        assert client.get("/server_info").json()["weight_version"] == "8"


def test_control_endpoint_shapes(model_dir, tmp_path):
    moved = perturbed_checkpoint(model_dir, tmp_path / "moved", seed=2)
    expected = greedy_ids(moved)
    srv = LiveServer(AsyncEngine(config(model_dir)))
    with srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.get("/health_generate").status_code == 200
        info = client.get("/server_info").json()
        assert info == client.get("/get_server_info").json()
        assert info["weight_version"] == "0" and info["model_path"] == str(model_dir) and not info["is_paused"]
        # abort_all: requests held by an in-place pause end now with what they have
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert client.get("/server_info").json()["is_paused"]
        results: list = []
        senders = [threading.Thread(target=lambda: results.append(client.post("/generate", json={
            "text": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}).json()))
            for _ in range(3)]
        for s in senders:
            s.start()
        deadline = time.monotonic() + 30
        while len(srv.engine._streams) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        load = client.get("/v1/loads", params={"include": "core,disagg,queues"}).json()["loads"][0]
        assert load["num_reqs"] == 3 and load["num_running_reqs"] + load["num_waiting_reqs"] == 3
        r = client.post("/abort_request", json={"abort_all": True})
        assert r.json() == {"success": True, "num_aborted": 3}
        for s in senders:
            s.join(30)
        assert [x["meta_info"]["finish_reason"]["type"] for x in results] == ["abort"] * 3
        assert client.get("/v1/loads").json()["loads"][0]["num_reqs"] == 0
        assert client.get("/health_generate").status_code == 200  # paused: the engine thread still answers
        client.post("/continue_generation")
        r = client.post("/abort_request", json={})
        assert r.status_code == 400 and "abort_all" in r.json()["error"]["message"]

        r = client.post("/update_weights_from_disk", json={"model_path": str(moved), "weight_version": "v2"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "weight_version"
        r = client.post("/update_weights_from_disk", json={"model_path": str(moved), "weight_version": "5"})
        assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "5", r.text
        assert client.get("/get_weight_version").json() == {"weight_version": "5"}
        result = generate(client)
        assert result["output_ids"] == expected and result["meta_info"]["weight_version"] == "5"
        r = client.post("/update_weights_from_disk", json={"model_path": str(moved), "weight_version": "5"})
        assert r.status_code == 400 and client.get("/get_weight_version").json() == {"weight_version": "5"}
        r = client.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "backend"
        assert client.get("/health_generate").status_code == 200
