"""ACP v1 wire types for what the client sends us (validated with pydantic), named as the schema names them.

Only the fields this agent reads are declared; everything else (``_meta``, newer optional fields) is accepted and
ignored, as the protocol's extensibility rules ask. Outgoing messages are plain dicts built in ``updates.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

PROTOCOL_VERSION = 1


class WireModel(BaseModel):
    """Base: camelCase aliases, unknown fields allowed."""

    model_config = ConfigDict(populate_by_name=True, extra="allow")


class FileSystemCapabilities(WireModel):
    read_text_file: bool = Field(False, alias="readTextFile")
    write_text_file: bool = Field(False, alias="writeTextFile")


class ClientCapabilities(WireModel):
    fs: FileSystemCapabilities = FileSystemCapabilities()
    terminal: bool = False


class InitializeParams(WireModel):
    protocol_version: Annotated[StrictInt, Field(ge=0, le=65535)] | StrictStr = Field(alias="protocolVersion")
    """An integer; early clients sent a date string (a legacy version, answered with ours like any other)."""
    client_capabilities: ClientCapabilities = Field(ClientCapabilities(), alias="clientCapabilities")
    client_info: dict[str, Any] | None = Field(None, alias="clientInfo")


class AuthenticateParams(WireModel):
    method_id: str = Field(alias="methodId")


class EnvVariable(WireModel):
    name: str
    value: str


class McpServer(WireModel):
    """An MCP server the client asks us to connect to: stdio (``command``) or, unsupported here, http/sse."""

    name: str
    type: str | None = None
    command: str | None = None
    args: list[str] = []
    env: list[EnvVariable] = []
    url: str | None = None


class NewSessionParams(WireModel):
    cwd: str
    mcp_servers: list[McpServer] = Field(alias="mcpServers")


class LoadSessionParams(WireModel):
    session_id: str = Field(alias="sessionId")
    cwd: str
    mcp_servers: list[McpServer] = Field(default_factory=list, alias="mcpServers")


class ListSessionsParams(WireModel):
    cwd: str | None = None
    cursor: str | None = None


class SessionParams(WireModel):
    """Any request that only names a session (``session/cancel``, ``session/close``)."""

    session_id: str = Field(alias="sessionId")


class SetModeParams(WireModel):
    session_id: str = Field(alias="sessionId")
    mode_id: str = Field(alias="modeId")


class TextBlock(WireModel):
    type: Literal["text"]
    text: str


class ResourceLinkBlock(WireModel):
    type: Literal["resource_link"]
    uri: str
    name: str
    mime_type: str | None = Field(None, alias="mimeType")
    title: str | None = None


class TextResource(WireModel):
    uri: str
    text: str
    mime_type: str | None = Field(None, alias="mimeType")


class BlobResource(WireModel):
    uri: str
    blob: str
    mime_type: str | None = Field(None, alias="mimeType")


class ResourceBlock(WireModel):
    type: Literal["resource"]
    resource: TextResource | BlobResource


class MediaBlock(WireModel):
    """Image or audio: not advertised in our prompt capabilities, so refused with a clear error."""

    type: Literal["image", "audio"]
    data: str
    mime_type: str = Field(alias="mimeType")


ContentBlock = Annotated[Union[TextBlock, ResourceLinkBlock, ResourceBlock, MediaBlock], Field(discriminator="type")]


class PromptParams(WireModel):
    session_id: str = Field(alias="sessionId")
    prompt: list[ContentBlock] = Field(min_length=1)
