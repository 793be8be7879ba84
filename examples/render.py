"""Render a chat and two completion prompts through vllm_servicer.v1.Render: the token ids
the engine would run, with no generation; derender token ids back into text; and a
router's whole loop: render a chat, generate by its token ids, derender the output.

    python examples/render.py 127.0.0.1:50051
    python examples/render.py HOST:PORT --api-key KEY   # default: $VLLM_API_KEY

The chat goes through the model's chat template (which must exist), with one
tool whose parameters are a JSON schema. Prints one line per call, the call's
name and its result as JSON:

    render_chat: {"token_ids":[1,523,...],"text":"<|system|>..."}
    render_completion: [{"token_ids":[1,...],"text":"..."},{"token_ids":[1,...],"text":"..."}]
    derender_completion: [{"text":"Hello, world","finish_reason":"length"}]
    router_loop: {"token_ids":[...],"content":"...","reasoning":null,"tool_calls":[],...}

The derender takes the first prompt's tokens (without the BOS) as if the engine had
generated them after the second prompt. The loop is what a router that generates by
token ids does: RenderChat, then vLLM's own protocol (vllm.Inference's Generate, on
the same server) with the rendered ids, greedy, for 8 tokens, then DerenderChat of
the ids it gave: the content, reasoning and tool calls are what vLLM's
/v1/chat/completions answers for the same chat (with the server's parsers).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import grpc

from vllm_servicer.proto import inference_pb2, inference_pb2_grpc, render_pb2, render_pb2_grpc

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city's name"}},
    "required": ["city"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="for a server with authentication (default: $VLLM_API_KEY)",
    )
    return parser.parse_args(argv)


def as_json(prompt: render_pb2.RenderedPrompt) -> dict[str, Any]:
    return {"token_ids": list(prompt.token_ids), "text": prompt.text}


FINISH = {"STOP": "stop", "LENGTH": "length", "ABORTED": "abort"}


def generated_sequence(output: inference_pb2.SequenceOutput) -> render_pb2.GeneratedSequence:
    """What vllm.Inference generated, as Render's GeneratedSequence."""
    finish = output.finish_info
    sequence = render_pb2.GeneratedSequence(
        index=output.index,
        token_ids=output.token_ids,
        finish_reason=FINISH[inference_pb2.FinishInfo.FinishReason.Name(finish.finish_reason)],
    )
    # An EOS stops with no stop reason, as in vLLM's OpenAI answers.
    which = finish.WhichOneof("stop_reason")
    if which == "stop_token_id":
        sequence.stop_token_id = finish.stop_token_id
    elif which == "stop_string":
        sequence.stop_string = finish.stop_string
    return sequence


def show(name: str, value: Any) -> None:
    print(f"{name}:", json.dumps(value, separators=(",", ":")), flush=True)


def main(args: argparse.Namespace) -> None:
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    with grpc.insecure_channel(args.address) as channel:
        stub = render_pb2_grpc.RenderStub(channel)

        request = render_pb2.RenderChatRequest(
            messages=[
                render_pb2.ChatMessage(role="system", content="You are a helpful assistant."),
                render_pb2.ChatMessage(role="user", content="What is the weather in Paris?"),
            ],
            tools=[
                render_pb2.Tool(
                    name="get_weather",
                    description="The current weather in a city",
                    parameters=json.dumps(WEATHER_PARAMETERS),
                )
            ],
        )
        chat = stub.RenderChat(request, timeout=60, metadata=metadata)
        show("render_chat", as_json(chat))

        request = render_pb2.RenderCompletionRequest(
            prompt=["Hello, world", "The capital of France is"]
        )
        completion = stub.RenderCompletion(request, timeout=60, metadata=metadata)
        show("render_completion", [as_json(p) for p in completion.prompts])

        first, second = completion.prompts
        request = render_pb2.DerenderCompletionRequest(
            prompts=[
                render_pb2.PromptGeneration(
                    prompt_token_ids=second.token_ids,
                    choices=[
                        render_pb2.GeneratedSequence(
                            token_ids=first.token_ids[1:], finish_reason="length"
                        )
                    ],
                )
            ]
        )
        derendered = stub.DerenderCompletion(request, timeout=60, metadata=metadata)
        show(
            "derender_completion",
            [{"text": c.text, "finish_reason": c.finish_reason} for c in derendered.choices],
        )

        # A router's loop: the chat rendered, generated by its ids, derendered.
        chat_request = render_pb2.RenderChatRequest(
            messages=[
                render_pb2.ChatMessage(role="system", content="You are a helpful assistant."),
                render_pb2.ChatMessage(role="user", content="Say hello."),
            ]
        )
        prompt = stub.RenderChat(chat_request, timeout=60, metadata=metadata)
        inference = inference_pb2_grpc.InferenceStub(channel)
        generated = inference.Generate(
            inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=prompt.token_ids),
                temperature=0.0,
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=8),
                response=inference_pb2.ResponseOptions(output_token_ids=True),
            ),
            timeout=60,
            metadata=metadata,
        )
        answer = stub.DerenderChat(
            render_pb2.DerenderChatRequest(
                chat=chat_request,
                prompt_token_ids=prompt.token_ids,
                choices=[generated_sequence(generated.outputs)],
            ),
            timeout=60,
            metadata=metadata,
        )
        choice = answer.choices[0]
        show(
            "router_loop",
            {
                "token_ids": list(generated.outputs.token_ids),
                "content": choice.content if choice.HasField("content") else None,
                "reasoning": choice.reasoning if choice.HasField("reasoning") else None,
                "tool_calls": [[c.name, c.arguments] for c in choice.tool_calls],
                "finish_reason": choice.finish_reason,
                "completion_tokens": answer.completion_tokens,
            },
        )


if __name__ == "__main__":
    try:
        main(parse_args())
    except grpc.RpcError as err:
        raise SystemExit(f"{err.code().name}: {err.details()}") from None
