"""The pure parts of the examples: the calculator's safe evaluation and answer matching, the
text-to-SQL agent's query extraction and execution-match comparison (plus the shipped data:
every worked solution gives its answer, every gold query runs on the shipped database), and the
keypad's feedback, reward and conversation (whose calls the trajectory aggregation merges)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_stream.domain.adapter.trajectory import aggregate_triplets
from agl_stream.models import Triplet
from agl_stream.policy.model import build_tokenizer
from examples.calculator import calc_agent as calc
from examples.keypad import keypad_agent as keypad
from examples.text_to_sql import sql_agent as sql

# -- the calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("14 * 24", 336),
        ("(12 + 3) * 4", 60),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-4 + 11", 7),
        ("2 ^ 10", 1024),
        ("2 ** -1", 0.5),
        ("17 % 5", 2),
        ("sqrt(81) + abs(-2)", 11.0),
        ("round(10 / 3, 2)", 3.33),
        ("max(3, 9, 4) - min(3, 9, 4)", 6),
        ("6 × 7 ÷ 2", 21.0),  # noqa: RUF001 - the multiplication sign people type
        (" 1e3 + 0.5 ", 1000.5),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert calc.evaluate(expression) == pytest.approx(value)


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('/etc/passwd').read()", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("x + 1", "not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("'a' * 3", "not a number"),
        ("True + 1", "not a number"),
        ("lambda: 1", "not allowed"),
        ("1 if 2 else 3", "not allowed"),
        ("sqrt(x=4)", "positional"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 20", "exceeds"),
        ("2 ** 60 * 2 ** 60", "exceeds"),
        ("sqrt(-1)", "negative"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an expression"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than"),
        ("(" * 100 + "1" + ")" * 100, None),  # parser or evaluator nesting limits: an error either way
    ],
)
def test_calculator_refuses_everything_else(expression: str, why: str | None) -> None:
    with pytest.raises(calc.CalculatorError, match=why):
        calc.evaluate(expression)


def test_calculator_tool_answers_values_and_errors_as_text() -> None:
    assert calc.run_calculator(json.dumps({"expression": "2.75 * 18"})) == "49.5"
    assert calc.run_calculator(json.dumps({"expression": "96 / 8"})) == "12"  # integral: no ".0"
    assert calc.run_calculator(json.dumps({"expression": "10 / 3"})) == "3.333333333"
    assert calc.run_calculator(json.dumps("3 + 4")) == "7"  # a bare string is taken as the expression
    assert calc.run_calculator(json.dumps({"expression": "1/0"})) == "error: division by zero"
    assert calc.run_calculator("{not json").startswith("error: the arguments are not JSON")
    assert calc.run_calculator(json.dumps({"expr": "1"})).startswith("error: call calculator")


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("The total is 336.\nANSWER: 336", "336"),
        ("answer: -7", "-7"),
        ("So the answer is 1,250.5 dollars", "1,250.5"),
        ("First 12 then 24. ANSWER: 3/4", "3/4"),
        ("I computed 12 and then 49.5", "49.5"),  # no marker: the last number
        ("ANSWER: 12 apples, not 13", "12"),  # the marker wins over later numbers
        ("no numbers here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(reply: str | None, answer: str | None) -> None:
    assert calc.extract_answer(reply) == answer


@pytest.mark.parametrize(
    ("answer", "gold", "match"),
    [
        ("336", 336, True),
        ("336.0", 336, True),
        ("1,250.5", 1250.5, True),
        ("3/4", 0.75, True),
        ("3.33", 10 / 3, True),  # rounded to the decimals given
        ("3.3", 10 / 3, False),  # one decimal is too coarse to count as the same number
        ("3.34", 10 / 3, False),
        ("337", 336, False),
        ("-7", 7, False),
        ("1/0", 0, False),
        (None, 0, False),
    ],
)
def test_answers_match_numerically(answer: str | None, gold: float, match: bool) -> None:
    assert calc.answers_match(answer, gold) is match


def test_answer_reward() -> None:
    assert calc.answer_reward("ANSWER: 49.50", 49.5) == 1.0
    assert calc.answer_reward("ANSWER: 50", 49.5) == 0.0
    assert calc.answer_reward(None, 1) == 0.0


def test_calculator_data_is_consistent() -> None:
    train, val = calc.load_tasks(calc.TRAIN_FILE), calc.load_tasks(calc.VAL_FILE)
    assert len(train) == 30 and len(val) == 10
    assert len({t["id"] for t in train + val}) == 40
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    for task in train + val:
        assert calc.answers_match(calc.format_number(calc.evaluate(task["expression"])), task["answer"]), task


# -- text to SQL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "query"),
    [
        ("```sql\nSELECT 1;\n```", "SELECT 1"),
        ("First try:\n```sql\nSELECT 1\n```\nBetter:\n```SQL\nSELECT 2;;\n```", "SELECT 2"),
        ("```\nSELECT name FROM t\n```", "SELECT name FROM t"),
        ("The query is SELECT COUNT(*) FROM books;", "SELECT COUNT(*) FROM books"),
        ("with x as (select 1) select * from x", "with x as (select 1) select * from x"),
        ("I do not know.", None),
        ("```sql\n\n```", None),
        (None, None),
    ],
)
def test_extract_sql(reply: str | None, query: str | None) -> None:
    assert sql.extract_sql(reply) == query


def test_results_match_unordered_as_multisets() -> None:
    gold = [("a", 1), ("b", 2)]
    assert sql.results_match([("b", 2), ("a", 1)], gold, ordered=False)
    assert sql.results_match([("a", 1.0), ("b", 2)], gold, ordered=False)  # 1 and 1.0 are one value
    assert not sql.results_match([("a", 1), ("b", 2), ("b", 2)], gold, ordered=False)  # duplicates count
    assert not sql.results_match([("a", 1)], gold, ordered=False)
    assert not sql.results_match([("a", 1, None), ("b", 2, None)], gold, ordered=False)  # columns count


def test_results_match_ordered_and_float_noise() -> None:
    assert not sql.results_match([("b",), ("a",)], [("a",), ("b",)], ordered=True)
    assert sql.results_match([("a",), ("b",)], [("a",), ("b",)], ordered=True)
    assert sql.results_match([(0.1 + 0.2,)], [(0.3,)], ordered=False)
    assert not sql.results_match([(0.31,)], [(0.3,)], ordered=False)
    assert sql.results_match([], [], ordered=False)


@pytest.mark.parametrize(
    ("query", "ordered"),
    [
        ("SELECT a FROM t ORDER BY a", True),
        ("select a from t order  by a desc limit 1", True),
        ("SELECT a FROM (SELECT a FROM t ORDER BY a) AS s", False),  # inner order only
        ("SELECT 'ORDER BY' FROM t", False),  # inside a string
        ("SELECT a FROM t", False),
    ],
)
def test_is_ordered(query: str, ordered: bool) -> None:
    assert sql.is_ordered(query) is ordered


def test_schema_text_is_the_create_statements() -> None:
    text = sql.schema_text(sql.SCRIPTS["library"].read_text())
    assert text.count("CREATE TABLE") == 4 and "INSERT" not in text


# The rest open a SQLite file under pytest's tmp_path: local, hermetic, milliseconds.


@pytest.fixture
def library(tmp_path: Path) -> Path:
    return sql.build_database(sql.SCRIPTS["library"], tmp_path / "library.sqlite")


def test_execution_match_compares_results_not_text(library: Path) -> None:
    gold = "SELECT title FROM books WHERE genre = 'science'"
    assert sql.execution_match(library, "select b.title from books as b where b.genre in ('science')", gold)
    assert not sql.execution_match(library, "SELECT title FROM books WHERE genre = 'history'", gold)
    assert not sql.execution_match(library, "SELECT title, genre FROM books WHERE genre = 'science'", gold)
    ordered_gold = "SELECT title FROM books WHERE published_year > 2015 ORDER BY published_year"
    assert sql.execution_match(library, ordered_gold, ordered_gold)
    assert not sql.execution_match(library, ordered_gold + " DESC", ordered_gold)


@pytest.mark.parametrize(
    "bad",
    [
        "SELEC title FROM books",
        "SELECT nope FROM books",
        "DROP TABLE books",
        "DELETE FROM books",
        "INSERT INTO authors VALUES (99, 'x', 'y', 1)",
        "SELECT 1; DROP TABLE books",
        "ATTACH DATABASE '{folder}/elsewhere.db' AS other",
        "PRAGMA query_only = OFF",
        "",
        None,
    ],
)
def test_bad_or_writing_queries_are_no_match_and_change_nothing(library: Path, bad: str | None) -> None:
    gold = "SELECT COUNT(*) FROM books"
    if bad is not None:
        bad = bad.format(folder=library.parent)
    assert sql.execution_match(library, bad, gold) is False
    assert sql.run_query(library, gold) == [(12,)]
    assert sorted(p.name for p in library.parent.iterdir()) == ["library.sqlite"]  # no file was made


def test_a_runaway_query_is_interrupted(library: Path) -> None:
    forever = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    with pytest.raises(sql.QueryError, match="longer than"):
        sql.run_query(library, forever, timeout_s=0.2)


def test_every_gold_query_runs_and_answers(library: Path) -> None:
    train, val = sql.load_tasks(sql.TRAIN_FILE), sql.load_tasks(sql.VAL_FILE)
    assert len(train) + len(val) == 20
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    for task in train + val:
        assert task["db"] in sql.SCRIPTS
        assert sql.run_query(library, task["gold_sql"]), task  # a non-empty answer
        assert sql.execution_match(library, task["gold_sql"], task["gold_sql"])


# -- the keypad -------------------------------------------------------------------------------------


def test_keypad_feedback_and_reward() -> None:
    assert keypad.feedback("12a4") == "3/4 digits ok. next:"
    assert keypad.feedback("") == "0/0 digits ok. next:"
    assert keypad.episode_reward(["1234", "12ab", "abcd"]) == pytest.approx(0.5)
    assert keypad.episode_reward(["", "9", ""]) == pytest.approx(1 / 3)
    assert keypad.episode_reward([]) == 0.0


def test_keypad_conversation_alternates_answers_and_feedback() -> None:
    assert keypad.conversation("pin:", ["12", "x"]) == [
        {"role": "user", "content": "pin:"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "2/2 digits ok. next:"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "0/1 digits ok. next:"},
    ]


@pytest.mark.parametrize("ended_by_eos", [True, False])
def test_keypad_calls_merge_into_one_trajectory_sample(ended_by_eos: bool) -> None:
    """With the tiny policy's ChatML template each call's prompt continues the previous prompt +
    response token for token (an answer cut at max_tokens has no end-of-turn token: the template
    inserts it), so trajectory aggregation makes one sample of the three calls, masked 0 exactly
    on the inserted end-of-turn and feedback tokens."""
    tokenizer = build_tokenizer()
    answers = ["12a4", "", "9876"]
    calls = []
    for turn, answer in enumerate(answers):
        text = tokenizer.apply_chat_template(
            keypad.conversation("pin:", answers[:turn]), add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        response = tokenizer.encode(answer, add_special_tokens=False)
        if ended_by_eos or not answer:  # an empty answer always ended with the end-of-turn token
            response.append(tokenizer.eos_token_id)
        calls.append(Triplet(prompt_token_ids=prompt, response_token_ids=response))
    samples, breaks = aggregate_triplets(calls, "trajectory")
    assert not breaks and len(samples) == 1
    sample = samples[0]
    assert sample.calls == 3 and sample.prompt_token_ids == calls[0].prompt_token_ids
    last = calls[-1]
    assert sample.prompt_token_ids + sample.response_token_ids == last.prompt_token_ids + last.response_token_ids
    assert sample.response_mask is not None
    generated = [t for t, m in zip(sample.response_token_ids, sample.response_mask, strict=True) if m == 1]
    assert generated == [t for call in calls for t in call.response_token_ids]
    assert len(aggregate_triplets(calls, "transition").samples) == 3


def test_keypad_data_is_consistent() -> None:
    train, val = keypad.load_tasks(keypad.TRAIN_FILE), keypad.load_tasks(keypad.VAL_FILE)
    assert len(train) == 8 and len(val) == 2
    assert len({t["id"] for t in train + val}) == 10
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in val}
    tokenizer = build_tokenizer()
    for task in train + val:  # every character is in the tiny policy's alphabet
        assert tokenizer.unk_token_id not in tokenizer.encode(task["prompt"], add_special_tokens=False)
