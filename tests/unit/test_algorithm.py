"""The algorithm layer without a cluster: datasets, epochs, @algo, the registry, Baseline's plan
and enqueue window, the reward report's rows, the blocking store facade."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import agl_stream as agl
from agl_stream.algorithm import (
    ALGORITHMS,
    Algorithm,
    Baseline,
    BlockingStore,
    FunctionalAlgorithm,
    MissingComponentError,
    algo,
    epoch_orders,
    load_dataset,
    make_algorithm,
    register_algorithm,
)
from agl_stream.algorithm import baseline as baseline_module
from agl_stream.algorithm.report import REWARD_VALUE_KEY, ModeReport, reports_from_rows, rewards_query
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AglError, AlgorithmError, DatasetError

TASKS = [{"question": f"{i}+{i}", "answer": 2 * i} for i in range(5)]

# -- datasets ------------------------------------------------------------------------------------


def test_sequences_and_iterables_load_as_lists() -> None:
    assert load_dataset(TASKS) == TASKS
    assert load_dataset(tuple(TASKS)) == TASKS
    assert load_dataset(task for task in TASKS) == TASKS
    assert load_dataset(["a", 1, 2.5, None, [1, 2]]) == ["a", 1, 2.5, None, [1, 2]]
    assert load_dataset(None) is None
    assert load_dataset([]) == []


class Indexable:
    """Sized and indexable, but no Sequence (as some dataset classes are)."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> dict[str, int]:
        if index >= 3:
            raise IndexError(index)
        return {"i": index}


def test_duck_typed_datasets_load() -> None:
    assert load_dataset(Indexable()) == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_jsonl_file_loads_one_task_per_line(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in TASKS) + "\n\n")
    assert load_dataset(path) == TASKS
    assert load_dataset(str(path)) == TASKS


def test_a_json_file_holds_one_array(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(TASKS))
    assert load_dataset(path) == TASKS
    path.write_text(json.dumps({"tasks": TASKS}))
    with pytest.raises(DatasetError, match="one array"):
        load_dataset(path)


def test_a_parquet_file_loads_its_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "tasks.parquet"
    parquet.write_table(pa.Table.from_pylist(TASKS), path)
    assert load_dataset(path) == TASKS
    assert load_dataset(pa.Table.from_pylist(TASKS)) == TASKS  # a Table, in memory


def test_a_hugging_face_dataset_and_a_dataframe_load_their_rows() -> None:
    datasets = pytest.importorskip("datasets")
    assert load_dataset(datasets.Dataset.from_list(TASKS)) == TASKS
    pandas = pytest.importorskip("pandas")
    assert load_dataset(pandas.DataFrame(TASKS)) == TASKS


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"question": "1+1"}, "a dict is not a dataset"),
        (42, "a value of type int is not a dataset"),
        (b"raw", "bytes are not a dataset"),
        ("no/such/file.jsonl", "no such file"),
        ([{"ok": 1}, {"bad": {1, 2}}], r"dataset\[1\] is not JSON"),
        ([float("nan")], r"dataset\[0\] is not JSON"),
        ([object()], r"dataset\[0\] is not JSON"),
    ],
)
def test_what_is_no_dataset_is_refused_with_a_typed_error(source: Any, message: str) -> None:
    with pytest.raises(DatasetError, match=message) as caught:
        load_dataset(source)
    assert isinstance(caught.value, AglError) and isinstance(caught.value, ValueError)


def test_bad_files_say_where_they_are_bad(tmp_path: Path) -> None:
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"ok": 1}\n{not json\n')
    with pytest.raises(DatasetError, match="line 2 is not JSON"):
        load_dataset(lines, name="train_dataset")
    other = tmp_path / "tasks.csv"
    other.write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"train_dataset: .*tasks.csv is neither"):
        load_dataset(other, name="train_dataset")


def test_epochs_run_every_index_once_each_in_order_without_shuffle() -> None:
    assert epoch_orders(4, epochs=3) == [[0, 1, 2, 3]] * 3
    assert epoch_orders(0, epochs=2) == [[], []]


def test_shuffled_epochs_are_permutations_that_the_seed_decides() -> None:
    orders = epoch_orders(20, epochs=3, shuffle=True, seed=7)
    assert all(sorted(order) == list(range(20)) for order in orders)
    assert orders[0] != orders[1], "each epoch has an order of its own"
    assert orders == epoch_orders(20, epochs=3, shuffle=True, seed=7), "the same seed, the same orders"
    assert orders != epoch_orders(20, epochs=3, shuffle=True, seed=8)
    with pytest.raises(DatasetError, match="epochs must be at least 1"):
        epoch_orders(3, epochs=0)


# -- @algo and the base class -----------------------------------------------------------------------


def test_algo_passes_only_what_the_function_declares() -> None:
    seen: dict[str, Any] = {}

    @algo
    def only_store(*, store: Any) -> None:
        seen["store"] = store

    @algo
    def everything(
        *, store: Any, train_dataset: Any, val_dataset: Any, llm_proxy: Any, adapter: Any, initial_resources: Any
    ) -> None:
        seen.update(train=train_dataset, val=val_dataset, proxy=llm_proxy, adapter=adapter, resources=initial_resources)

    assert isinstance(only_store, FunctionalAlgorithm) and isinstance(only_store, agl.Algorithm)
    assert not only_store.is_async() and only_store.__name__ == "only_store"
    only_store.set_store("the store")
    only_store.run()
    assert seen == {"store": "the store"}
    everything.set_store("s")
    everything.set_adapter(AdapterConfig())
    everything.set_llm_proxy("http://proxy/v1")
    everything.set_initial_resources({"prompt": "p"})
    everything.run(train_dataset=[1], val_dataset=[2])
    assert seen["train"] == [1] and seen["val"] == [2] and seen["proxy"] == "http://proxy/v1"
    assert seen["adapter"] == AdapterConfig() and seen["resources"] == {"prompt": "p"}


def test_an_async_algo_is_awaited_and_the_name_still_calls_the_function() -> None:
    @algo
    async def count(*, train_dataset: Sequence[Any]) -> int:
        return len(train_dataset)

    assert count.is_async()
    assert asyncio.run(count.run(train_dataset=[1, 2, 3])) == 3
    assert asyncio.run(count(train_dataset=[1])) == 1  # the decorated name calls the function itself


def test_algo_refuses_what_it_cannot_fill_and_data_it_would_drop() -> None:
    with pytest.raises(AlgorithmError, match=r"parameter\(s\) \['learning_rate'\] cannot be filled"):

        @algo
        def bad(*, store: Any, learning_rate: float) -> None: ...

    @algo
    def train_only(*, train_dataset: Any, learning_rate: float = 0.1) -> None: ...

    with pytest.raises(AlgorithmError, match="val_dataset was given"):
        train_only.run(train_dataset=[1], val_dataset=[2])


def test_components_that_were_not_set_are_typed_errors() -> None:
    class Mine(Algorithm):
        async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
            self.get_store()

    mine = Mine()
    assert mine.is_async() and mine.runner_resources == "pinned" and list(mine.roles(Settings())) == []
    for getter in (mine.get_store, mine.get_trainer, mine.get_adapter):
        with pytest.raises(MissingComponentError):
            getter()
    with pytest.raises(ValueError):  # the seed's error type, for code that catches it
        asyncio.run(mine.run())
    assert mine.get_initial_resources() is None and mine.get_llm_proxy() is None


def test_the_trainer_is_held_weakly() -> None:
    class Owner:
        n_runners = 2

    owner, algorithm = Owner(), Baseline()
    algorithm.set_trainer(owner)
    assert algorithm.get_trainer() is owner
    del owner
    with pytest.raises(MissingComponentError, match="gone"):
        algorithm.get_trainer()


# -- the registry ------------------------------------------------------------------------------------


def test_built_ins_are_found_by_name_and_mapping() -> None:
    assert ALGORITHMS["baseline"] is Baseline
    assert isinstance(make_algorithm("Baseline"), Baseline)
    made = make_algorithm({"name": "baseline", "n_epochs": 3, "shuffle": True})
    assert isinstance(made, Baseline) and made.n_epochs == 3 and made.shuffle
    assert isinstance(make_algorithm({"type": "baseline"}), Baseline)  # the seed's configs say "type"
    assert isinstance(make_algorithm(Baseline), Baseline)
    given = Baseline()
    assert make_algorithm(given) is given and make_algorithm(None) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("verl-nope", r"no algorithm named 'verl-nope'; registered: \['apo', 'baseline'"),
        ({"n_epochs": 2}, "names its algorithm with 'name'"),
        ({"name": "baseline", "epochs": 2}, "does not take these arguments"),
        (lambda store: None, "decorate it with @agl.algo"),
        (3.5, "a value of type float is not an algorithm"),
    ],
)
def test_what_is_no_algorithm_is_refused_with_a_typed_error(spec: Any, message: str) -> None:
    with pytest.raises(AlgorithmError, match=message):
        make_algorithm(spec)


def test_a_name_is_registered_once() -> None:
    class Other(Algorithm):
        pass

    register_algorithm("unit-test-other", Other)
    try:
        register_algorithm("Unit-Test-Other", Other)  # the same factory again: fine
        assert isinstance(make_algorithm("unit-test-other"), Other)
        with pytest.raises(AlgorithmError, match="registered already"):
            register_algorithm("baseline", Other)
    finally:
        ALGORITHMS.pop("unit-test-other")


# -- Baseline ------------------------------------------------------------------------------------------


def test_baseline_plans_train_then_val_in_every_epoch() -> None:
    plan = Baseline(n_epochs=2).plan(["t0", "t1"], ["v0"])
    assert plan == [[("train", "t0"), ("train", "t1"), ("val", "v0")]] * 2
    shuffled = Baseline(n_epochs=3, shuffle=True, seed=1).plan(list(range(10)), ["v0", "v1"])
    assert shuffled == Baseline(n_epochs=3, shuffle=True, seed=1).plan(list(range(10)), ["v0", "v1"])
    assert [sorted(t for m, t in epoch if m == "train") for epoch in shuffled] == [list(range(10))] * 3
    assert Baseline().plan(None, ["v"]) == [[("val", "v")]]


def test_baseline_refuses_no_data_and_bad_arguments() -> None:
    with pytest.raises(DatasetError, match="needs a train_dataset or a val_dataset"):
        Baseline().plan(None, [])
    with pytest.raises(DatasetError, match="n_epochs"):
        Baseline(n_epochs=0)
    with pytest.raises(ValueError, match="train_split"):
        Baseline(train_split=1.5)  # the seed's check
    with pytest.raises(ValueError, match="max_in_flight"):
        Baseline(max_in_flight=0)


class FakeStore:
    """Records what Baseline asks; every rollout finishes when it is waited for."""

    def __init__(self) -> None:
        self.enqueued: list[dict[str, Any]] = []
        self.unfinished: set[str] = set()
        self.most_unfinished = 0
        self.resources: list[Mapping[str, Any]] = []

    async def add_resources(self, resources: Mapping[str, Any]) -> Any:
        self.resources.append(resources)
        return SimpleNamespace(resources_id="rs-1")

    async def enqueue_many_rollouts(self, requests: Sequence[Mapping[str, Any]]) -> list[Any]:
        made = []
        for request in requests:
            rid = f"ro-{len(self.enqueued)}"
            self.enqueued.append({**request, "rollout_id": rid})
            self.unfinished.add(rid)
            made.append(SimpleNamespace(rollout_id=rid))
        self.most_unfinished = max(self.most_unfinished, len(self.unfinished))
        return made

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Any]:
        self.unfinished -= set(rollout_ids)
        return [SimpleNamespace(rollout_id=rid, status="succeeded") for rid in rollout_ids]


@pytest.fixture
def no_sql(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    asked: list[list[str]] = []

    async def report(store: Any, ids: Sequence[str], *, fenced: bool = True) -> dict[str, ModeReport]:
        asked.append(list(ids))
        return {"train": ModeReport("train", len(ids), len(ids), 0, 0, len(ids), 0.5)}

    monkeypatch.setattr(baseline_module, "rewards_by_mode", report)
    yield asked


def test_baseline_enqueues_everything_pins_its_resources_and_reports(no_sql: list[list[str]]) -> None:
    store = FakeStore()
    baseline = Baseline(n_epochs=2)
    baseline.set_store(store)
    baseline.set_initial_resources({"prompt": {"resource_type": "prompt_template", "template": "{q}"}})
    asyncio.run(baseline.run(train_dataset=["a", "b", "c"], val_dataset=["v"]))
    assert [(r["mode"], r["input"]) for r in store.enqueued] == [
        ("train", "a"),
        ("train", "b"),
        ("train", "c"),
        ("val", "v"),
    ] * 2
    assert {r["resources_id"] for r in store.enqueued} == {"rs-1"} and len(store.resources) == 1
    assert no_sql == [[r["rollout_id"] for r in store.enqueued]]  # one report over every rollout
    assert baseline.report["train"].mean_reward == 0.5 and baseline.rollout_ids == no_sql[0]


def test_baseline_keeps_at_most_max_in_flight_unfinished(no_sql: list[list[str]]) -> None:
    store = FakeStore()
    baseline = Baseline(max_in_flight=4)
    baseline.set_store(store)
    asyncio.run(baseline.run(train_dataset=list(range(11))))
    assert len(store.enqueued) == 11 and not store.unfinished
    assert store.most_unfinished <= 4
    assert {r["resources_id"] for r in store.enqueued} == {None}  # no initial resources: the latest, if any


# -- the reward report -----------------------------------------------------------------------------------


def test_the_report_query_reads_the_primary_reward_of_the_latest_attempt() -> None:
    sql, parameters = rewards_query(Settings(clickhouse_database="agl_x"), ["ro-1", "ro-2"])
    assert REWARD_VALUE_KEY == "agentlightning.reward.0.value"
    assert parameters == {"ids": ["ro-1", "ro-2"], "reward_key": REWARD_VALUE_KEY}
    assert "agl_x.rollouts FINAL" in sql and "agl_x.otel_traces" in sql and "argMax(attempt_id, sequence_id)" in sql


def test_report_rows_become_mode_reports() -> None:
    rows = [
        {
            "mode": "train",
            "rollouts": 4,
            "succeeded": 3,
            "failed": 1,
            "cancelled": 0,
            "rewarded": 3,
            "mean_reward": 0.5,
        },
        {"mode": "val", "rollouts": 2, "succeeded": 1, "failed": 0, "cancelled": 0, "rewarded": 0, "mean_reward": None},
    ]
    reports = reports_from_rows(rows)
    assert reports["train"] == ModeReport("train", 4, 3, 1, 0, 3, 0.5)
    assert reports["val"].mean_reward is None and reports["val"].unfinished == 1


# -- the blocking store ----------------------------------------------------------------------------------


class AsyncThing:
    label = "plain attribute"

    async def double(self, x: int) -> int:
        return 2 * x


def test_a_blocking_store_runs_calls_on_the_stores_loop() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        blocking = BlockingStore(AsyncThing(), loop)
        assert blocking.double(21) == 42 and blocking.label == "plain attribute"

        async def on_the_loop() -> None:
            blocking.double(1)

        with pytest.raises(RuntimeError, match="own event loop"):
            asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(timeout=120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=120)
        loop.close()
