"""What the server refuses or cuts, as its clients hear it: OpenAI's error body with an HTTP status (docs/server.md,
"Answers and errors"), and the reader cut for not taking its audio."""

from __future__ import annotations

from starlette.responses import JSONResponse


class SpeechError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_stopped() -> SpeechError:
    return SpeechError(
        503,
        "the server's engine has stopped (its log says why): retry once the server is restarted (GET /ready)",
        code="engine_stopped",
    )


class ReaderGone(Exception):
    """A client that fell too far behind its stream (--max-unsent-seconds) or took none of it for a while
    (rvqtts.serving.streams.STALLED_READER_SECONDS): its connection is closed."""


FELL_BEHIND = "it fell behind its audio by more than --max-unsent-seconds"
