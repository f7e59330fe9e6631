"""An agent, as users write them: multi-turn conversations through the real ``openai`` and
``anthropic`` SDKs. Run by the real-client tests with the clients venv's python (it imports
nothing of this project):

    python agent.py '{"base_url": ..., "kind": "chat_stream", "api_key": ..., "seeds": [1, 2],
                      "turns": 4}'

Each conversation has a long system prompt of its own (seeded words) and short user turns;
each turn re-sends the whole history with the assistant's last answer, so every later turn
shares the earlier prefix, as an agent's turns do. Prints one JSON object: every call's
parsed output as the SDK gave it (``model_dump``: the whole answer, or the list of stream
events), and the usage the client saw (None when the stream carried none).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Callable
from typing import Any

import anthropic
import openai

MODEL = "tiny-llama"
WORDS = [
    "kalo",
    "miren",
    "tasvu",
    "pedor",
    "silny",
    "quabex",
    "torela",
    "fingru",
    "hapjis",
    "kelmon",
    "renvu",
    "dorsil",
    "nyqua",
    "bexela",
    "grufin",
    "jiskel",
]
MAX_TOKENS = 8
TOOL_MAX_TOKENS = 24
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Looks a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]
TIMEOUT = 120.0


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def dump(obj: Any) -> Any:
    return obj.model_dump(mode="json")


Call = tuple[Any, str, Any]  # (parsed output, assistant text, usage the client saw)


class OpenAIAgent:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.kind = plan["kind"]
        self.user = plan.get("user")
        common = {
            "base_url": plan["base_url"] + "/v1",
            "api_key": plan["api_key"],
            "max_retries": 0,
            "timeout": TIMEOUT,
        }
        self.client = openai.OpenAI(**common)
        self.new_async_client = lambda: openai.AsyncOpenAI(**common)

    def extra(self) -> dict[str, Any]:
        return {"user": self.user} if self.user else {}

    def call(self, system: str, turns: list[dict[str, str]]) -> Call:
        kind = self.kind
        messages = [{"role": "system", "content": system}, *turns]
        if kind == "chat_n2":  # two sequences of one prompt
            answer = self.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                n=2,
                seed=7,
                **self.extra(),
            )
            return dump(answer), answer.choices[0].message.content or "", dump(answer.usage)
        if kind.startswith("chat"):
            stream = "stream" in kind
            options = {"stream_options": {"include_usage": True}} if "usage" in kind else {}
            if kind.endswith("_async"):
                return asyncio.run(self.chat_async(messages, options))
            return self.chat(messages, stream, options)
        if kind.startswith("tools"):
            choice: Any = {
                "tools_required": "required",
                "tools_auto": "auto",
                "tools_named": {"type": "function", "function": {"name": "lookup"}},
            }[kind]
            answer = self.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=TOOL_MAX_TOKENS,
                temperature=0.0,
                tools=TOOLS,
                tool_choice=choice,
                **self.extra(),
            )
            message = answer.choices[0].message
            text = message.content or "".join(
                call.function.arguments for call in message.tool_calls or []
            )
            return dump(answer), text, dump(answer.usage)
        if kind.startswith("completions"):
            prompt = system + "\n" + "\n".join(turn["content"] for turn in turns) + "\n"
            return self.completion(prompt)
        if kind.startswith("responses"):
            return self.response(messages)
        raise ValueError(f"unknown kind {kind}")

    def chat(self, messages: list[dict[str, str]], stream: bool, options: dict[str, Any]) -> Call:
        if not stream:
            answer = self.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                **self.extra(),
            )
            return dump(answer), answer.choices[0].message.content or "", dump(answer.usage)
        chunks, text, usage = [], "", None
        for chunk in self.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            **options,
            **self.extra(),
        ):
            chunks.append(dump(chunk))
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
            if chunk.usage is not None:
                usage = dump(chunk.usage)
        return chunks, text, usage

    async def chat_async(self, messages: list[dict[str, str]], options: dict[str, Any]) -> Call:
        chunks, text, usage = [], "", None
        async with self.new_async_client() as client:  # one event loop per call
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
                **options,
                **self.extra(),
            )
            async for chunk in stream:
                chunks.append(dump(chunk))
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
                if chunk.usage is not None:
                    usage = dump(chunk.usage)
        return chunks, text, usage

    def completion(self, prompt: str) -> Call:
        kind = self.kind
        if kind in ("completions_whole", "completions_echo"):
            answer = self.client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                echo=kind == "completions_echo",
                **self.extra(),
            )
            text = answer.choices[0].text
            if kind == "completions_echo":
                text = text[len(prompt) :]
            return dump(answer), text, dump(answer.usage)
        options = (
            {"stream_options": {"include_usage": True}}
            if kind == "completions_stream_usage"
            else {}
        )
        chunks, text, usage = [], "", None
        for chunk in self.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            **options,
            **self.extra(),
        ):
            chunks.append(dump(chunk))
            text += "".join(choice.text for choice in chunk.choices)
            if chunk.usage is not None:
                usage = dump(chunk.usage)
        return chunks, text, usage

    def response(self, messages: list[dict[str, str]]) -> Call:
        if self.kind == "responses_whole":
            answer = self.client.responses.create(
                model=MODEL,
                input=messages,
                max_output_tokens=MAX_TOKENS,
                temperature=0.0,
                **self.extra(),
            )
            return dump(answer), answer.output_text, dump(answer.usage)
        events, text, usage = [], "", None
        for event in self.client.responses.create(
            model=MODEL,
            input=messages,
            max_output_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            **self.extra(),
        ):
            events.append(dump(event))
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                usage = dump(event.response.usage)
        return events, text, usage


class AnthropicAgent:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.kind = plan["kind"]
        self.user = plan.get("user")
        self.client = anthropic.Anthropic(
            base_url=plan["base_url"], api_key=plan["api_key"], max_retries=0, timeout=TIMEOUT
        )

    def call(self, system: str, turns: list[dict[str, str]]) -> Call:
        # This SDK release has no temperature argument; vLLM reads it from the body.
        extra: dict[str, Any] = {"extra_body": {"temperature": 0.0}}
        if self.user:
            extra["metadata"] = {"user_id": self.user}
        if self.kind == "messages_whole":
            answer = self.client.messages.create(
                model=MODEL, system=system, messages=turns, max_tokens=MAX_TOKENS, **extra
            )
            text = "".join(block.text for block in answer.content if block.type == "text")
            return dump(answer), text, dump(answer.usage)
        events, text, usage = [], "", None
        for event in self.client.messages.create(
            model=MODEL, system=system, messages=turns, max_tokens=MAX_TOKENS, stream=True, **extra
        ):
            events.append(dump(event))
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
            if event.type == "message_delta":
                usage = dump(event.usage)
        return events, text, usage


def conversation(
    call: Callable[[str, list[dict[str, str]]], Call], seed: int, turns: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    system = prose(rng, 250)
    history: list[dict[str, str]] = []
    calls = []
    for index in range(turns):
        history.append({"role": "user", "content": f"step {index}: " + prose(rng, 4)})
        parsed, text, usage = call(system, history)
        history.append({"role": "assistant", "content": text or "(nothing)"})
        calls.append({"seed": seed, "turn": index, "parsed": parsed, "usage": usage})
    return calls


def main() -> int:
    plan = json.loads(sys.argv[1])
    agent = AnthropicAgent(plan) if plan["kind"].startswith("messages") else OpenAIAgent(plan)
    calls = []
    for seed in plan["seeds"]:
        calls.extend(conversation(agent.call, seed, plan["turns"]))
    json.dump({"calls": calls}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
