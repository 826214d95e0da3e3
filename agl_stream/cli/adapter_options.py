"""The trace adapter's options, shared by the commands that derive triplets (`triplets`, `replay`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from agl_stream.domain.adapter import AdapterConfig

LlmCallMatch = Annotated[
    str | None, typer.Option(help="Regex on span names that marks LLM calls (default: the openai spans).")
]
AgentMatch = Annotated[
    str | None, typer.Option(help="Regex on agent names: keep only LLM calls made inside matching agents.")
]
RewardMatch = Annotated[str, typer.Option(help="How rewards find their LLM call: first_occurrence or first_sibling.")]
ExcludeLlmCallInReward = Annotated[
    bool, typer.Option(help="Drop LLM calls made inside reward spans (LLM-as-judge calls).")
]
AggregationOption = Annotated[
    str,
    typer.Option(
        "--aggregation",
        help="transition: one training sample per LLM call; trajectory: consecutive calls that continue "
        "each other's tokens merged into one sample (tool and user tokens masked out of the loss).",
    ),
]


def adapter_config(
    llm_call_match: str | None,
    agent_match: str | None,
    reward_match: str,
    exclude_llm_call_in_reward: bool,
    aggregation: str = "transition",
) -> AdapterConfig:
    """The AdapterConfig the options say (its defaults where they say nothing); a bad value is a usage error."""
    from agl_stream.domain.adapter import AdapterConfig

    options: dict[str, object] = {
        "agent_match": agent_match,
        "reward_match": reward_match,
        "exclude_llm_call_in_reward": exclude_llm_call_in_reward,
        "aggregation": aggregation,
    }
    if llm_call_match is not None:
        options["llm_call_match"] = llm_call_match
    try:
        return AdapterConfig.model_validate(options)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
