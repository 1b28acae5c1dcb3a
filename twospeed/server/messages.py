"""Chat messages: their request model and OpenAI's rules for a conversation with tool calls.

The rules, as OpenAI's API enforces them (each a 400 naming the message):
- a `tool` message has a `tool_call_id` and content, and answers a call of the assistant message it
  follows (other tool messages may sit between them);
- an assistant message's `tool_calls` are `{"id", "type": "function", "function": {"name", "arguments"}}`
  with `arguments` a string, ids unique, and every call is answered by a tool message before the next
  non-tool message (or the end of the conversation);
- a `function` message (the deprecated form) has a `name` and content.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from twospeed.server.errors import APIError


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Model):
    type: Literal["text"]  # images and audio are not supported
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        """The message as a chat template reads it: content parts joined to one string."""
        out = self.model_dump(exclude_none=True)
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise APIError(400, f"a {self.role!r} message needs content", param="messages")
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


def check_conversation(messages: list[ChatMessage]) -> None:
    """OpenAI's rules for tool calls and tool messages (the module docstring lists them)."""
    pending: dict[str, int] = {}  # ids of the last assistant message's calls not yet answered -> its index
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.role != "tool" and pending:
            _unanswered(pending)
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError(400, f"{where}: a 'tool' message needs a tool_call_id (the id of the call it answers)",
                               param=f"{where}.tool_call_id")
            if m.content is None:
                raise APIError(400, f"{where}: a 'tool' message needs content", param=f"{where}.content")
            if m.tool_call_id not in pending:
                raise APIError(400, f"{where}: messages with role 'tool' must answer a tool call of the assistant "
                                    f"message before them; no pending call has id {m.tool_call_id!r}",
                               param=f"{where}.tool_call_id")
            del pending[m.tool_call_id]
        elif m.role == "function" and (not m.name or m.content is None):
            raise APIError(400, f"{where}: a 'function' message needs a name and content", param=where)
        elif m.role == "assistant" and m.tool_calls:
            pending = {_check_call(call, f"{where}.tool_calls.{j}"): i for j, call in enumerate(m.tool_calls)}
            if len(pending) != len(m.tool_calls):
                raise APIError(400, f"{where}: tool_calls ids must be unique", param=f"{where}.tool_calls")
    if pending:
        _unanswered(pending)


def _check_call(call: dict, where: str) -> str:
    fn = call.get("function")
    if (not isinstance(call.get("id"), str) or not call["id"] or call.get("type") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)):
        raise APIError(400, f"{where}: a tool call is {{\"id\": str, \"type\": \"function\", \"function\": "
                            f"{{\"name\": str, \"arguments\": str}}}}", param=where)
    return call["id"]


def _unanswered(pending: dict[str, int]) -> None:
    index = next(iter(pending.values()))
    raise APIError(400, f"messages.{index}: an assistant message with 'tool_calls' must be followed by tool "
                        f"messages answering each tool_call_id; not answered: {', '.join(pending)}",
                   param=f"messages.{index}.tool_calls")
