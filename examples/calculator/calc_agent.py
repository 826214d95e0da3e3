"""A calculator math agent: multi-turn chat with an OpenAI ``calculator`` tool, rewarded by answer match.

The agent asks the model to solve an arithmetic word problem. It is written three ways, each
an ``@agl.rollout`` function the runner traces with no change to the agent's code:
:func:`calculator_agent` on the openai client, :func:`langgraph_calculator_agent` with LangChain's
``create_agent`` (a LangGraph graph) and :func:`agents_sdk_calculator_agent` with the OpenAI
Agents SDK (``pip install 'agl-stream[frameworks]'`` for those two). Whenever the model calls the
``calculator`` tool, the agent evaluates the expression with :func:`evaluate` (a whitelist
over Python's ``ast``: numbers, + - * / // % **, parentheses and a few functions; model output
never reaches ``eval``) and hands back the value; each evaluation is a span of its own
(``calculator``: the expression, the value or the error). When the model answers without a
tool call, its last line ``ANSWER: <number>`` (or else its last number) is compared with the
task's answer numerically (:func:`answers_match`): the reward is 1.0 or 0.0.

Tasks are JSON objects ``{"id", "question", "expression", "answer"}`` (``data/*.jsonl``);
``expression`` is one worked solution, kept for reading and for scripted tests, never shown to
the model. The module is pure apart from :func:`calculator_agent`, which calls the model.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry import trace

import agl_stream as agl
from agl_stream.models import LLM

HERE = Path(__file__).resolve().parent
TRAIN_FILE = HERE / "data" / "train.jsonl"
VAL_FILE = HERE / "data" / "val.jsonl"

# Short on purpose: the CPU inference backend's tiny policy reads the prompt character by
# character, and a long prompt costs it more than the whole rest of the rollout.
SYSTEM_PROMPT = (
    "Solve the math word problem. Call the calculator tool for each computation. Finish with one line: ANSWER: <number>"
)

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** parentheses, sqrt abs round min max).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12 + 3) * 4"}},
            "required": ["expression"],
        },
    },
}

MAX_TURNS = 6
"""Model calls per rollout: tool rounds plus the final answer (a model that keeps calling the
tool is cut off and scored on what it said last)."""

MAX_TOKENS = 256
"""Completion tokens per call unless the LLM resource's sampling parameters say otherwise."""

# -- the calculator: a whitelist over the expression's syntax tree ------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
"""Largest absolute value of any intermediate result: keeps ``10**10**10``-style input from
eating memory (checked after every operation, so no step can grow a number past it)."""
MAX_EXPONENT = 64


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator evaluates (the message says why)."""


Number = int | float


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("zero cannot be raised to a negative power")
    result = operator.pow(base, exponent)
    if isinstance(result, complex):
        raise CalculatorError("the result is not a real number")
    return result


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _sqrt(value: Number) -> Number:
    if value < 0:
        raise CalculatorError("sqrt of a negative number")
    return math.sqrt(value)


def _round(value: Number, digits: Number = 0) -> Number:
    if not isinstance(digits, int) or not 0 <= digits <= 12:
        raise CalculatorError("round() takes 0 to 12 digits")
    return round(value, digits) if digits else round(value)


_FUNCTIONS: dict[str, Callable[..., Number]] = {"sqrt": _sqrt, "abs": abs, "round": _round, "min": min, "max": max}


def _checked(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a value exceeds {MAX_MAGNITUDE:g}")
    return value


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        # bool is an int subclass, and True + 1 is not arithmetic anyone asked for.
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"{node.value!r} is not a number")
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"a value exceeds {MAX_MAGNITUDE:g}") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords or not node.args:
            raise CalculatorError(f"{node.func.id}() takes positional numbers only")
        return _checked(_FUNCTIONS[node.func.id](*(_evaluate(arg) for arg in node.args)))
    raise CalculatorError(f"{type(node).__name__} is not allowed in an arithmetic expression")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; :class:`CalculatorError` for anything else.

    Accepted: int and float literals, ``+ - * / // % **`` (``^`` too, read as a power, as people
    write it), unary signs, parentheses and ``sqrt abs round min max``. Names, attributes,
    subscripts, comprehensions, strings and every other construct are refused before anything
    is evaluated, and sizes are bounded (length, exponents, magnitudes).
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")  # noqa: RUF001
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an expression: {error.msg}") from None
    except (RecursionError, MemoryError, ValueError):  # pathological nesting, NUL bytes
        raise CalculatorError("the expression cannot be parsed") from None
    try:
        return _evaluate(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    except TypeError as error:  # a function given the wrong number of arguments
        raise CalculatorError(str(error)) from None


def format_number(value: Number) -> str:
    """A value as the tool reports it: integral values without a fraction, others to 10 digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def calculate(expression: str) -> str:
    """The tool's answer: the expression's value, or ``error: <why>`` for the model to read (a
    bad call is the model's mistake to fix, never the rollout's crash)."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as error:
        return f"error: {error}"


def run_calculator(arguments: str) -> str:
    """The tool's answer to a call's JSON arguments (see :func:`calculate`)."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return 'error: the arguments are not JSON; call calculator with {"expression": "..."}'
    expression = parsed.get("expression") if isinstance(parsed, dict) else parsed
    if not isinstance(expression, str):
        return 'error: call calculator with {"expression": "..."}'
    return calculate(expression)


# -- answers and the reward ---------------------------------------------------------------------

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+"
_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_answer(text: str | None) -> str | None:
    """The final answer in a reply: the number after the last ``ANSWER:``, else the last number."""
    if not text:
        return None
    marked = _ANSWER_LINE.findall(text)
    if marked:
        return str(marked[-1])
    numbers = _ANY_NUMBER.findall(text)
    return str(numbers[-1]) if numbers else None


def to_number(answer: str | None) -> float | None:
    """``"1,234.5"``, ``"-3"``, ``"7/4"`` as numbers; None when it is none."""
    if answer is None:
        return None
    text = answer.replace(",", "").replace(" ", "")
    try:
        if "/" in text:
            numerator, denominator = text.split("/", 1)
            return float(numerator) / float(denominator)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str | None, gold: float) -> bool:
    """Whether an extracted answer equals the gold number.

    Equal within a relative 1e-6, or the gold value rounded to the decimals the answer gives
    when it gives at least two (``3.33`` for 10/3): models round, and rounding is not wrong.
    """
    value = to_number(answer)
    if value is None:
        return False
    if math.isclose(value, gold, rel_tol=1e-6, abs_tol=1e-9):
        return True
    assert answer is not None
    decimals = answer.rsplit(".", 1)[1] if "." in answer and "/" not in answer else ""
    return len(decimals) >= 2 and round(gold, len(decimals)) == round(value, len(decimals))


def answer_reward(reply: str | None, gold: float) -> float:
    """1.0 when the reply's final answer matches ``gold``, else 0.0."""
    return 1.0 if answers_match(extract_answer(reply), float(gold)) else 0.0


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """The tasks of a JSON-lines file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the agent ------------------------------------------------------------------------------------


def _sampling(llm: LLM) -> dict[str, Any]:
    """The call's sampling arguments: the resource's, with a bound on the completion length."""
    allowed = ("temperature", "top_p", "max_tokens", "seed")
    sampling = {k: v for k, v in llm.sampling_parameters.items() if k in allowed}
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return sampling


@agl.rollout
async def calculator_agent(task: dict[str, Any], llm: LLM) -> float:
    """Solve one task with the calculator tool; the reward is the final answer's match (0 or 1)."""
    from openai import AsyncOpenAI  # imported in the runner only: the trainer process never needs it

    tracer = trace.get_tracer("examples.calculator")
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=1)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    reply = ""
    try:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=llm.model,
                messages=messages,  # type: ignore[arg-type]
                tools=[CALCULATOR_TOOL],  # type: ignore[list-item]
                **_sampling(llm),
            )
            message = response.choices[0].message
            reply = message.content or ""
            calls = [call for call in (message.tool_calls or []) if call.type == "function"]
            assistant: dict[str, Any] = {"role": "assistant", "content": reply}
            if calls:
                assistant["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": c.function.model_dump(include={"name", "arguments"})}
                    for c in calls
                ]
            messages.append(assistant)
            if not calls:
                break
            for call in calls:
                with tracer.start_as_current_span("calculator") as span:
                    span.set_attribute("tool.name", call.function.name)
                    span.set_attribute("tool.call_id", call.id)
                    span.set_attribute("tool.arguments", call.function.arguments)
                    if call.function.name == "calculator":
                        result = run_calculator(call.function.arguments)
                    else:
                        result = f"error: there is no tool {call.function.name!r}; use calculator"
                    span.set_attribute("tool.result", result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    return answer_reward(reply, float(task["answer"]))


# -- the same agent with LangGraph and with the OpenAI Agents SDK ---------------------------------
#
# The runner instruments both frameworks through OpenTelemetry's GenAI instrumentations: their
# agent and tool spans join the attempt's trace, with one chat span per model call (LangChain's
# for LangGraph, the openai client's for the Agents SDK) and the LLM proxy's span under it. The
# model calls go through the LLM resource's endpoint (the proxy, with a ProxyLLM), so each
# becomes a triplet exactly as the plain agent's do.

CALCULATOR_DESCRIPTION = str(CALCULATOR_TOOL["function"]["description"])


@agl.rollout
async def langgraph_calculator_agent(task: dict[str, Any], llm: LLM) -> float:
    """:func:`calculator_agent` as a LangGraph agent (LangChain's ``create_agent``)."""
    from langchain.agents import create_agent
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    sampling = _sampling(llm)
    model = ChatOpenAI(
        model=llm.model,
        base_url=llm.endpoint,
        api_key=llm.api_key or "none",  # type: ignore[arg-type]
        max_retries=1,
        temperature=sampling.get("temperature"),
        max_tokens=sampling["max_tokens"],  # type: ignore[call-arg]
    )
    tool = StructuredTool.from_function(calculate, name="calculator", description=CALCULATOR_DESCRIPTION)
    agent = create_agent(model, tools=[tool], system_prompt=SYSTEM_PROMPT, name="calculator_agent")
    # Each turn is a model node and a tool node: a model that keeps calling the tool is cut off
    # (and scores 0: it gave no answer).
    try:
        result = await agent.ainvoke(
            {"messages": [{"role": "user", "content": task["question"]}]}, {"recursion_limit": 2 * MAX_TURNS}
        )
    except GraphRecursionError:
        return 0.0
    return answer_reward(result["messages"][-1].text, float(task["answer"]))


@agl.rollout
async def agents_sdk_calculator_agent(task: dict[str, Any], llm: LLM) -> float:
    """:func:`calculator_agent` with the OpenAI Agents SDK (its chat-completions model: the LLM
    proxy and vLLM serve ``/v1/chat/completions``, not the Responses API)."""
    from agents import Agent, MaxTurnsExceeded, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from openai import AsyncOpenAI

    sampling = _sampling(llm)
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=1)
    tool = function_tool(calculate, name_override="calculator", description_override=CALCULATOR_DESCRIPTION)
    agent = Agent(
        name="calculator_agent",
        instructions=SYSTEM_PROMPT,
        tools=[tool],
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        model_settings=ModelSettings(temperature=sampling.get("temperature"), max_tokens=sampling["max_tokens"]),
    )
    try:
        result = await Runner.run(agent, task["question"], max_turns=MAX_TURNS)
    except MaxTurnsExceeded:  # a model that keeps calling the tool gave no answer
        return 0.0
    finally:
        await client.close()
    return answer_reward(str(result.final_output), float(task["answer"]))
