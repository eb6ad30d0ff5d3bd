"""The server client: each conversation's turns through an OpenAI-compatible chat endpoint
(vLLM, SGLang), many conversations at once, with retries on what a busy server answers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import requests

from dflash.regenerate.records import Conversation, Reply, Sampling, Work
from dflash.regenerate.shards import Progress, ShardWriter

REQUEST_TIMEOUT_S = 3600.0  # one long reply from a busy server
RETRIES = 5  # attempts per request on connection errors, timeouts, 5xx and 429


class Rejected(Exception):
    """The server refused a request (HTTP 4xx): that record is skipped, the run goes on."""


class Server:
    """An OpenAI-compatible endpoint (vLLM, SGLang): one chat completion per reply. Each
    worker thread has its own HTTP session (``requests`` sessions are not shared safely)."""

    def __init__(self, url: str, model: str | None, sampling: Sampling):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.sampling = sampling
        self.local = threading.local()
        self.model = model or self.served_model()

    def session(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def served_model(self) -> str:
        """The first model the server lists: the one it was started with."""
        try:
            response = self.session().get(f"{self.base}/v1/models", timeout=60)
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (requests.RequestException, ValueError, KeyError, IndexError) as e:
            raise RuntimeError(f"no model listed at {self.base}/v1/models ({e}): is the server up? "
                               "(--model names the model without asking)") from None

    def body(self, messages: list[dict[str, str]]) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": self.sampling.max_new_tokens}
        if self.sampling.temperature is not None:
            body["temperature"] = self.sampling.temperature
        if self.sampling.top_p is not None:
            body["top_p"] = self.sampling.top_p
        if self.sampling.template_kwargs:
            body["chat_template_kwargs"] = dict(self.sampling.template_kwargs)
        return body

    def chat(self, messages: list[dict[str, str]]) -> Reply:
        """One reply, retried with backoff on connection errors, timeouts, 5xx and 429."""
        error = ""
        for attempt in range(RETRIES):
            try:
                response = self.session().post(f"{self.base}/v1/chat/completions", json=self.body(messages),
                                               timeout=REQUEST_TIMEOUT_S)
            except (requests.ConnectionError, requests.Timeout) as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if response.ok:
                    return self.reply(response.json())
                if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                    raise Rejected(f"HTTP {response.status_code}: {response.text[:200]}")
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            time.sleep(min(2**attempt, 30))
        raise RuntimeError(f"{self.base}/v1/chat/completions failed {RETRIES} times, last: {error}")

    @staticmethod
    def reply(data: dict) -> Reply:
        """``finish_reason == "length"`` is a reply that broke off at ``max_tokens``."""
        choice = data["choices"][0]
        tokens = (data.get("usage") or {}).get("completion_tokens", 0)
        return Reply(choice["message"].get("content") or "", tokens, choice.get("finish_reason") != "length")


def converse(server: Server, conversation: Conversation) -> Conversation:
    """Every reply of one record, in order, each with the ones before as context."""
    while not conversation.done:
        try:
            conversation.add(server.chat(conversation.prompt()))
        except Rejected as e:
            conversation.skip(f"rejected: {e}")
    return conversation


def regenerate_server(server: Server, work: Work, concurrency: int, writer: ShardWriter, *, progress: Progress
                      ) -> int:
    """Records in a pool of ``concurrency`` threads (the server batches them), written as
    they finish. A failure cancels what has not started. Returns the tokens generated."""
    tokens = 0
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="regenerate")
    try:
        futures = [pool.submit(converse, server, c) for window in work.windows.values() for c in window]
        for future in as_completed(futures):
            conversation = future.result()
            writer.write([conversation])
            tokens += conversation.tokens
            progress.update(1, conversation.tokens)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return tokens
