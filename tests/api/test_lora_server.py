"""LoRA adapters served as vLLM serves them: --enable-lora with --lora-modules (NAME=PATH and the
JSON form) loaded at start, a request's `model` naming an adapter runs with it (its tokens those of
the offline LLM with the same adapter, and not the base model's), /v1/models lists the adapters
under the served model, /v1/load_lora_adapter and /v1/unload_lora_adapter with
--allow-runtime-lora-updating (404 without it), an adapter the engine cannot serve refused
naming why while the server goes on, vllm:lora_requests_info in /metrics, and the flags checked
before the model loads. One server for the module, on the tiny Qwen2-VL checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from tests.api.conftest import Server, start_server
from tests.lora_adapters import LANGUAGE_MODEL, WHOLE_MODEL, write_adapter
from vlmserve.api import engine_supervisor
from vlmserve.api.dp_client import DataParallelClient
from vlmserve.api.engine_client import EngineClient
from vlmserve.api.engine_supervisor import EngineDeadError, EngineSupervisor
from vlmserve.api.metrics import Metrics
from vlmserve.api.options import add_arguments, check_lora_flags
from vlmserve.api.serving import ServingContext
from vlmserve.api.serving_models import LoadLoRAAdapterRequest, ServingModels, UnloadLoRAAdapterRequest
from vlmserve.arg_types import LoRAModulePath
from vlmserve.engine.config import EngineConfig
from vlmserve.errors import APIError, UsageError
from vlmserve.ipc.messages import AddLoRA, ListLoRAs, LoRAReply, RemoveLoRA, Stats
from vlmserve.lora import LoRAError, LoRARequest

CHAT = "/v1/chat/completions"
MAX_TOKENS = 6
PROMPTS = ["Say something.", "Name a color."]
BASE = "tiny"


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters with large random lora_B (PEFT's zero B would change nothing): two served from the
    start, one loaded at run time, and three the engine must refuse."""
    root = tmp_path_factory.mktemp("adapters")
    found = {
        "sql": write_adapter(tiny_dir, root / "sql", 8, 16, LANGUAGE_MODEL, seed=1),
        "vision": write_adapter(tiny_dir, root / "vision", 4, 8, WHOLE_MODEL, seed=2),
        "late": write_adapter(tiny_dir, root / "late", 8, 16, LANGUAGE_MODEL, seed=3),
        "rank32": write_adapter(tiny_dir, root / "rank32", 32, 32, LANGUAGE_MODEL, seed=4),
    }
    # A target module the model does not have: "late"'s q_proj renamed qz_proj, config and weights.
    wrong = root / "wrong-module"
    wrong.mkdir()
    config = json.loads((found["late"] / "adapter_config.json").read_text())
    config["target_modules"] = ["qz_proj"]
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(found["late"] / "adapter_model.safetensors"))
    renamed = {k.replace(".q_proj.", ".qz_proj."): v for k, v in tensors.items() if ".q_proj." in k}
    save_file(renamed, str(wrong / "adapter_model.safetensors"))
    found["wrong-module"] = wrong
    return found


@pytest.fixture(scope="module")
def lora_server(
    tiny_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    vision = json.dumps({"name": "vision", "path": str(adapters["vision"]), "base_model_name": BASE})
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("lora"),
        "--enable-lora",
        "--lora-modules",
        f"sql={adapters['sql']}",
        vision,
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "4",
        "--allow-runtime-lora-updating",
        "--disable-web-ui",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(lora_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=lora_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_dir: Path, adapters: dict[str, Path]) -> dict[tuple[str, str], list[int]]:
    """The offline LLM's greedy tokens for each (model name, prompt), the adapters given by the
    same ids the server gives them (1, 2 in --lora-modules' order; 3 for the first loaded later)."""
    from vlmserve import LLM, SamplingParams
    from vlmserve.lora import LoRARequest

    loras = {
        BASE: None,
        "sql": LoRARequest("sql", 1, str(adapters["sql"])),
        "vision": LoRARequest("vision", 2, str(adapters["vision"])),
        "late": LoRARequest("late", 3, str(adapters["late"])),
    }
    llm = LLM(
        str(tiny_dir),
        dtype="float32",
        max_model_len=4096,
        kv_cache_memory_gib=0.05,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=4,
    )
    cases = [(name, prompt) for name in loras for prompt in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.chat(
        [_messages(prompt) for _, prompt in cases], params, lora_request=[loras[name] for name, _ in cases]
    )
    llm.shutdown()
    return {case: list(out.outputs[0].token_ids) for case, out in zip(cases, outputs, strict=True)}


def _chat_tokens(client: openai.OpenAI, model: str, prompt: str) -> list[int]:
    response = client.chat.completions.create(
        model=model,
        messages=_messages(prompt),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert response.model == model  # vLLM's: a response names the adapter it ran with
    return list(response.choices[0].model_extra["token_ids"])  # type: ignore[index]


# -- a request's model names an adapter ----------------------------------------------------------------


def test_adapters_and_the_base_model_in_concurrent_requests_give_the_offline_tokens(
    client: openai.OpenAI, offline: dict[tuple[str, str], list[int]]
) -> None:
    cases = [(name, prompt) for name in (BASE, "sql", "vision") for prompt in PROMPTS] * 2
    with ThreadPoolExecutor(len(cases)) as pool:
        served = list(pool.map(lambda case: _chat_tokens(client, *case), cases))
    for case, tokens in zip(cases, served, strict=True):
        assert tokens == offline[case], case
    for prompt in PROMPTS:  # the adapters change the answer: they were applied
        assert offline[("sql", prompt)] != offline[(BASE, prompt)]
        assert offline[("vision", prompt)] != offline[(BASE, prompt)]


def test_an_adapter_streams_and_completes_as_it_answers(
    lora_server: Server, client: openai.OpenAI, offline: dict[tuple[str, str], list[int]]
) -> None:
    prompt = PROMPTS[0]
    whole = client.chat.completions.create(
        model="sql", messages=_messages(prompt), temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    stream = client.chat.completions.create(
        model="sql",
        messages=_messages(prompt),
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"sql"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    # /v1/completions and /v1/responses take the adapter's name too.
    completion = client.completions.create(
        model="vision", prompt="Once upon a time", temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    base = client.completions.create(
        model=BASE, prompt="Once upon a time", temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    assert completion.model == "vision" and completion.choices[0].text != base.choices[0].text
    answer = lora_server.post("/v1/responses", {"model": "sql", "input": prompt, "max_output_tokens": MAX_TOKENS})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sql"


def test_an_unknown_model_is_still_vllms_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="sq1", messages=_messages("Hi"), max_tokens=2)
    assert e.value.status_code == 404
    assert "The model `sq1` does not exist." in str(e.value)


def test_models_lists_the_adapters_after_the_served_model(client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [BASE, "sql", "vision"]
    assert models[BASE].model_extra["parent"] is None  # type: ignore[index]
    for name in ("sql", "vision"):
        card = models[name].model_extra
        assert card["root"] == str(adapters[name])  # type: ignore[index]
        assert card["parent"] == BASE  # type: ignore[index]


# -- loading and unloading at run time -------------------------------------------------------------------


def test_an_adapter_loaded_at_run_time_is_served_until_it_is_unloaded(
    lora_server: Server, client: openai.OpenAI, adapters: dict[str, Path], offline: dict[tuple[str, str], list[int]]
) -> None:
    loaded = lora_server.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert list(models) == [BASE, "sql", "vision", "late"]
    assert models["late"] == models["late"] | {"root": str(adapters["late"]), "parent": BASE}
    assert _chat_tokens(client, "late", PROMPTS[0]) == offline[("late", PROMPTS[0])] != offline[(BASE, PROMPTS[0])]
    again = lora_server.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["sql"])})
    assert again.status_code == 400
    assert again.json()["error"]["message"].startswith("The lora adapter 'late' has already been loaded.")

    unloaded = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "vision"]
    with pytest.raises(openai.NotFoundError, match="The model `late` does not exist."):
        client.chat.completions.create(model="late", messages=_messages("Hi"), max_tokens=2)
    gone = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404
    assert (
        gone.json()["error"] | {"message": "The lora adapter 'late' cannot be found.", "type": "NotFoundError"}
        == (gone.json()["error"])
    )


@pytest.mark.parametrize(
    ("adapter", "status", "named"),
    [
        ("wrong-module", 400, ["adapter 'bad' cannot be loaded", "qz_proj"]),  # a target module the model lacks
        ("rank32", 400, ["has rank 32, above max_lora_rank 16", "--max-lora-rank"]),
        ("missing", 404, ["No adapter found for FOLDER"]),  # no such folder: vLLM's 404
    ],
)
def test_an_adapter_the_engine_cannot_serve_is_refused_naming_why_and_the_server_goes_on(
    lora_server: Server,
    client: openai.OpenAI,
    adapters: dict[str, Path],
    offline: dict[tuple[str, str], list[int]],
    adapter: str,
    status: int,
    named: list[str],
) -> None:
    path = adapters.get(adapter) or adapters["sql"].parent / adapter
    answer = lora_server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
    assert answer.status_code == status, answer.text
    message = answer.json()["error"]["message"].replace(str(path), "FOLDER")  # a path may hold any word
    for word in named:
        assert word in message, message
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "vision"]
    assert _chat_tokens(client, "sql", PROMPTS[1]) == offline[("sql", PROMPTS[1])]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="bad", messages=_messages("Hi"), max_tokens=2)


def test_loading_an_adapter_needs_the_api_key(lora_server: Server, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "late", "lora_path": str(adapters["late"])}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert httpx.post(lora_server.url + path, json=body, timeout=30).status_code == 401


def test_without_runtime_lora_updating_load_and_unload_are_404(server: Server, adapters: dict[str, Path]) -> None:
    """The session's default server (no --allow-runtime-lora-updating)."""
    body = {"lora_name": "late", "lora_path": str(adapters["late"])}
    assert server.post("/v1/load_lora_adapter", body).status_code == 404
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == [BASE]


# -- metrics -----------------------------------------------------------------------------------------


def _lora_info(server: Server) -> list[tuple[dict[str, str], float]]:
    families = text_string_to_metric_families(server.get("/metrics").text)
    return [(s.labels, s.value) for f in families if f.name == "vllm:lora_requests_info" for s in f.samples]


def test_lora_requests_info_names_the_adapters_of_the_running_requests(lora_server: Server) -> None:
    before = time.time()
    body = {"model": "vision", "messages": _messages("Count."), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    seen: list[tuple[dict[str, str], float]] = []
    with httpx.stream("POST", lora_server.url + CHAT, json=body, headers=lora_server.headers, timeout=120) as stream:
        for _ in stream.iter_lines():  # until the engine's stats (every 0.5 s) name it running
            seen = _lora_info(lora_server)
            if seen and seen[0][0]["running_lora_adapters"] == "vision":
                break
    ((labels, value),) = seen
    assert labels == {"max_lora": "2", "running_lora_adapters": "vision", "waiting_lora_adapters": ""}
    assert value >= before  # vLLM's value: when it was set


# -- the command line ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["sql"], "expected NAME=PATH or a JSON object"),
        (["=/tmp"], "an adapter needs a name and a path"),
        (['{"name": "sql"}'], "an adapter needs a name and a path"),
        (['{"name": "sql", "path": "/tmp", "rank": 8}'], "unknown field 'rank'"),
        (['{"name": "sql", "path": 3}'], "path must be a string, got 3"),
    ],
)
def test_a_malformed_lora_module_is_refused_naming_it(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-lora", "--lora-modules", *words])
    err = capsys.readouterr().err
    assert "--lora-modules" in err and message in err


def test_lora_modules_in_both_forms(adapters: dict[str, Path]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    vision = json.dumps({"name": "vision", "path": str(adapters["vision"]), "base_model_name": BASE})
    args = parser.parse_args(["--enable-lora", "--lora-modules", f"sql={adapters['sql']}", vision])
    assert [(m.name, m.path, m.base_model_name) for m in args.lora_modules] == [
        ("sql", str(adapters["sql"]), None),
        ("vision", str(adapters["vision"]), BASE),
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules", "sql={sql}"], "--lora-modules needs --enable-lora"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras (2) must be at least"),
        (["--enable-lora", "--lora-modules", "a={sql}", "a={vision}"], "--lora-modules names 'a' more than once"),
        (["--enable-lora", "--served-model-name", "sql", "--lora-modules", "sql={sql}"], "is a --served-model-name"),
        (["--enable-lora", "--lora-modules", "sql=/no/such/folder"], "'sql': /no/such/folder is not a directory"),
    ],
)
def test_lora_flags_that_cannot_work_together_are_refused(
    flags: list[str], message: str, adapters: dict[str, Path]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["model", *(f.format(sql=adapters["sql"], vision=adapters["vision"]) for f in flags)])
    with pytest.raises(UsageError) as e:
        check_lora_flags(args)
    assert message in str(e.value)


def test_a_malformed_lora_module_stops_the_server_before_the_model_loads(tiny_dir: Path) -> None:
    command = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", str(tiny_dir), "--enable-lora"]
    done = subprocess.run([*command, "--lora-modules", "sql"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "argument --lora-modules: expected NAME=PATH or a JSON object" in done.stderr
    assert "'sql'" in done.stderr


def test_an_adapter_the_engine_refuses_at_start_stops_the_server_naming_it(
    tiny_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    server = start_server(
        tiny_dir, tmp_path, "--enable-lora", "--lora-modules", f"big={adapters['rank32']}", wait=False
    )
    try:
        assert server.process.wait(120) != 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert f"the engine cannot start: adapter 'big' ({adapters['rank32']})" in log
    assert "has rank 32, above max_lora_rank 16" in log.replace(str(adapters["rank32"]), "FOLDER")


# -- the registry, the data-parallel calls and the metric, without a server ------------------------------


class FakeEngines:
    """The engines' adapter calls: refuses a path with "bad" in it, or is down."""

    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.held: dict[str, LoRARequest] = {}

    async def add_lora(self, lora: LoRARequest) -> None:
        if self.down:
            raise EngineDeadError("the engine is not running")
        if "bad" in lora.lora_path:
            raise LoRAError(f"rank 64 is above max_lora_rank 16 in {lora.lora_path}")
        self.held[lora.lora_name] = lora

    async def remove_lora(self, lora_name: str) -> bool:
        return self.held.pop(lora_name, None) is not None


def test_the_server_numbers_its_adapters_and_resolves_their_names(tmp_path: Path) -> None:
    for name in ("a", "b", "c", "bad"):
        (tmp_path / name).mkdir()
    engines = FakeEngines()
    models = ServingModels(engines, (BASE, "alias"))
    static = models.add_static(
        [LoRAModulePath("a", str(tmp_path / "a")), LoRAModulePath("b", str(tmp_path / "b"), "alias")]
    )
    assert [(lora.lora_name, lora.lora_int_id) for lora in static] == [("a", 1), ("b", 2)]
    assert [(c["id"], c["parent"], c["root"]) for c in models.cards(0)] == [
        ("a", BASE, str(tmp_path / "a")),
        ("b", "alias", str(tmp_path / "b")),
    ]
    ctx = ServingContext(None, None, None, None, BASE, served_model_names=(BASE, "alias"), models=models)  # type: ignore[arg-type]
    assert ctx.check_model("b") == static[1] and ctx.check_model("alias") is None and ctx.check_model(None) is None
    with pytest.raises(APIError) as e:
        ctx.check_model("z")
    assert e.value.status == 404

    assert asyncio.run(models.load(LoadLoRAAdapterRequest(lora_name="c", lora_path=str(tmp_path / "c")))).startswith(
        "Success"
    )
    assert engines.held["c"].lora_int_id == 3
    with pytest.raises(APIError) as e:
        asyncio.run(models.load(LoadLoRAAdapterRequest(lora_name="d", lora_path=str(tmp_path / "bad"))))
    assert (e.value.status, e.value.message) == (
        400,
        f"adapter 'd' cannot be loaded: rank 64 is above max_lora_rank 16 in {tmp_path / 'bad'}",
    )
    assert models.get("d") is None and "d" not in engines.held
    for name in (BASE, "alias"):
        with pytest.raises(APIError) as e:
            asyncio.run(models.load(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(tmp_path / "c"))))
        assert e.value.status == 400 and "served model's name" in e.value.message
    assert (
        asyncio.run(models.unload(UnloadLoRAAdapterRequest(lora_int_id=1)))
        == "Success: LoRA adapter 'a' removed successfully."
    )
    assert "a" not in engines.held and [c["id"] for c in models.cards(0)] == ["b", "c"]

    models.engines = FakeEngines(down=True)
    with pytest.raises(APIError) as e:
        asyncio.run(models.load(LoadLoRAAdapterRequest(lora_name="e", lora_path=str(tmp_path / "c"))))
    assert e.value.status == 503


def test_an_adapter_one_data_parallel_engine_refuses_is_dropped_by_the_others() -> None:
    ok, refusing = FakeEngines(), FakeEngines()
    refusing.add_lora = lambda lora: _raise(LoRAError("shape mismatch"))  # type: ignore[method-assign]
    client = DataParallelClient.__new__(DataParallelClient)
    client.engines = [ok, refusing]  # type: ignore[list-item]
    with pytest.raises(LoRAError, match="shape mismatch"):
        asyncio.run(client.add_lora(LoRARequest("a", 1, "/adapters/a")))
    assert ok.held == {}


async def _raise(e: Exception) -> None:
    raise e


def test_lora_requests_info_is_one_series_naming_every_engines_adapters() -> None:
    metrics = Metrics("tiny", 4096, num_engines=2, max_loras=3)
    stats = Stats(0, 0, 0.0, 0, 0, 0, 0, 0)
    before = time.time()
    metrics.update_engine(msgspec.structs.replace(stats, running_lora_adapters=["a", "b"]), 0, engine=0)
    metrics.update_engine(
        msgspec.structs.replace(stats, running_lora_adapters=["b", "c"], waiting_lora_adapters=["d"]), 0, engine=1
    )
    families = text_string_to_metric_families(metrics.render().decode())
    ((labels, value),) = [
        (s.labels, s.value) for f in families if f.name == "vllm:lora_requests_info" for s in f.samples
    ]
    assert labels == {"max_lora": "3", "running_lora_adapters": "a,b,c", "waiting_lora_adapters": "d"}
    assert value >= before
    assert b"vllm:lora_requests_info" not in Metrics("tiny", 4096).render()  # LoRA off: not published


def test_an_engine_started_again_loads_the_adapters_the_server_holds(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """What the engine client's adapter calls leave for the next engine process: the adapters added
    and not removed since, on its command line (one refused is not among them), and whether it is
    a restart."""
    client = EngineClient.__new__(EngineClient)
    client.engine = EngineSupervisor(EngineConfig(model=str(tiny_dir)), "ipc://in", "ipc://out", eos_token_ids=[])

    async def engine_answers(message: AddLoRA | RemoveLoRA | ListLoRAs) -> LoRAReply:
        if isinstance(message, AddLoRA) and message.lora.lora_name == "refused":
            return LoRAReply(message.call_id, error="rank 64 is above max_lora_rank 16")
        return LoRAReply(message.call_id, removed=isinstance(message, RemoveLoRA))

    client._lora_call = engine_answers  # type: ignore[method-assign]
    client._call_ids = itertools.count(1)
    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    asyncio.run(client.add_lora(a))
    asyncio.run(client.add_lora(b))
    with pytest.raises(LoRAError, match="rank 64 is above max_lora_rank 16"):
        asyncio.run(client.add_lora(LoRARequest("refused", 3, "/adapters/refused")))
    assert asyncio.run(client.remove_lora("a")) is True
    commands: list[list[str]] = []
    monkeypatch.setattr(engine_supervisor.subprocess, "Popen", lambda command, **_: commands.append(command))
    client.engine.spawn()  # the first start: every adapter must load
    client.engine.was_ready = True
    client.engine.spawn()  # a restart: one that cannot be read now is left out (the engine logs it)
    for command, restarted in zip(commands, (False, True), strict=True):
        given = command[command.index("--lora-modules") + 1]
        assert msgspec.json.decode(given, type=list[LoRARequest]) == [b]
        assert ("--restarted" in command) is restarted
