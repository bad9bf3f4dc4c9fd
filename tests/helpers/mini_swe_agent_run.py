"""mini-swe-agent, the real program from PyPI, run for a fixed number of steps against an OpenAI-compatible
base URL (``ctxfold serve``, or the engine itself for the control).

It is the agent as its users run it: ``DefaultAgent`` with its own text-based config
(``mini_textbased.yaml``: the system prompt, the task template, the observation and format-error
templates) and ``LitellmTextbasedModel`` (litellm's ``openai/`` provider with ``api_base``), the actions
parsed from ``mswea_bash_command`` blocks. What is set for a small model that will not solve anything:

- the loop never stops early: no cost limit (litellm has no price for a local model:
  ``cost_tracking: ignore_errors``), no limit on consecutive format errors (a malformed answer is answered
  with the config's format-error message and the loop goes on), the step limit is the run's length;
- no retries (``MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=1``): every request must be answered the first time;
- commands run in a temporary directory, and only read-only ones (:class:`ReadOnlyEnvironment`): what a
  270M model writes is not run on a shared machine; the others are answered as refused, which the agent
  reads like any failed command. The submit command does not end the run (the run's length is fixed).

Per model call it keeps the engine's ``usage.prompt_tokens`` and, through the proxy, ctxfold's count of
the prompt it sent (``X-Ctxfold-Prompt-Tokens``) and its compactions (``X-Ctxfold-Compactions``).
"""

from __future__ import annotations

import inspect
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.gemma_gguf import _missing

os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
# litellm fetches its price list from the network when imported; the copy in its wheel serves (and no
# price is asked for a local model anyway).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# Read-only programs; a command line with any shell operator or substitution is refused whole.
ALLOWED_PROGRAMS = frozenset({"ls", "cat", "head", "tail", "wc", "grep", "nl", "pwd", "echo", "sort", "uniq"})
SHELL_OPERATORS = set(";&|<>$`\\\n(){}")
# The task carries the file's numbers (as an issue quotes its data), so the agent's first request is about
# 2,000 tokens and its history outgrows 4,096 within the run's steps, though the agent drops every malformed
# answer from its history (mini-swe-agent v2 keeps only the format-error message).
NUMBERS = "".join(f"{(i * 7919) % 1000 - 500}\n" for i in range(400))
TASK = ("The file numbers.txt in the current directory holds one integer per line (they are listed below). "
        "Find their sum and write it into a new file sum.txt.\n\n" + NUMBERS)


def require_mini_swe_agent() -> Any:
    """The minisweagent module, or a skip (a failure with CTXFOLD_REQUIRE_LLAMA=1) naming the extra."""
    try:
        import minisweagent
    except ImportError:
        _missing("mini-swe-agent is not installed: pip install '.[agent]'")
    return minisweagent


@dataclass
class Call:
    """One model call of the agent, as the client saw it."""

    step: int  # 1-based
    reported: int | None  # the engine's usage.prompt_tokens
    predicted: int | None  # X-Ctxfold-Prompt-Tokens (None straight to the engine)
    compactions: int  # X-Ctxfold-Compactions
    finish_reason: str
    seconds: float


@dataclass
class AgentRun:
    """What one run left: the calls, the agent's own message list, how it ended."""

    calls: list[Call] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_sent: list[dict[str, Any]] = field(default_factory=list)  # the last answered request's messages
    last_answer: str = ""  # and the model's answer to it
    exit_status: str = ""
    error: BaseException | None = None

    def sent_history(self) -> list[dict[str, Any]]:
        """The conversation of the last answered request, its answer included (role and content): what the
        proxy's session of it holds. The agent's own list may lack that answer (a malformed answer is
        kept there only inside the format-error message's ``extra``)."""
        sent = [{"role": m["role"], "content": m["content"]} for m in self.last_sent]
        return [*sent, {"role": "assistant", "content": self.last_answer}]


def _header(response: Any, name: str) -> str | None:
    headers = (getattr(response, "_hidden_params", None) or {}).get("additional_headers") or {}
    value = headers.get(f"llm_provider-{name}", headers.get(name))
    return None if value is None else str(value)


def run_agent(base_url: str, workdir: Path, *, steps: int, max_tokens: int, on_call: Any = None) -> AgentRun:
    """mini-swe-agent for ``steps`` model calls against ``base_url`` (ending in ``/v1``), its commands run in
    ``workdir``. An exception from the model (a refusal) ends the run; it is kept in ``error``."""
    require_mini_swe_agent()
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    litellm.suppress_debug_info = True  # else a "Provider List" banner per call for a model it has no price for
    run = AgentRun()

    class ReadOnlyEnvironment(LocalEnvironment):
        def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
            command = str(action.get("command", ""))
            try:
                words = shlex.split(command)
            except ValueError as e:
                return {"output": f"refused: {e}", "returncode": 126, "exception_info": ""}
            if not words or words[0] not in ALLOWED_PROGRAMS or SHELL_OPERATORS & set(command):
                return {"output": f"refused: only plain {', '.join(sorted(ALLOWED_PROGRAMS))} commands run here",
                        "returncode": 126, "exception_info": ""}
            return super().execute(action, cwd, timeout=timeout)

        def _check_finished(self, output: dict[str, Any]) -> None:
            pass  # the run's length is fixed: a submission is an ordinary output here

    class RecordingModel(LitellmTextbasedModel):  # type: ignore[misc]
        def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            response = super()._query(messages, **kwargs)
            usage = getattr(response, "usage", None)
            predicted = _header(response, "x-ctxfold-prompt-tokens")
            call = Call(step=len(run.calls) + 1, reported=getattr(usage, "prompt_tokens", None),
                        predicted=None if predicted is None else int(predicted),
                        compactions=int(_header(response, "x-ctxfold-compactions") or 0),
                        finish_reason=str(response.choices[0].finish_reason), seconds=time.perf_counter() - t0)
            run.calls.append(call)
            run.last_sent, run.last_answer = messages, str(response.choices[0].message.content or "")
            if on_call is not None:
                on_call(call)
            return response

    config = get_config_from_spec("mini_textbased.yaml")
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}  # mode: the interactive agent's
    agent_config |= {"step_limit": steps, "cost_limit": 0.0, "max_consecutive_format_errors": 0,
                     "wall_time_limit_seconds": 0}
    model_config = dict(config["model"])
    model_config |= {"model_name": "openai/gemma-3-270m", "cost_tracking": "ignore_errors",
                     "model_kwargs": {**model_config.get("model_kwargs", {}), "api_base": base_url,
                                      "api_key": "unused", "max_tokens": max_tokens, "temperature": 0.0, "seed": 0,
                                      "timeout": 900}}
    (workdir / "numbers.txt").write_text(NUMBERS)
    env = ReadOnlyEnvironment(**{**config.get("environment", {}), "cwd": str(workdir), "timeout": 10})
    agent = DefaultAgent(RecordingModel(**model_config), env, **agent_config)
    try:
        result = agent.run(TASK)
        run.exit_status = str(result.get("exit_status", ""))
    except Exception as e:  # noqa: BLE001 - the control's refusal ends its run; the caller checks which
        run.error = e
        run.exit_status = type(e).__name__
    finally:
        _close_cached_clients(litellm)
    run.messages = [m for m in agent.messages if m.get("role") != "exit"]
    return run


def _close_cached_clients(litellm: Any) -> None:
    """Close the HTTP clients litellm keeps in its process-wide cache. Left open, their pooled sockets
    are reported unclosed when the interpreter exits, after every test has passed."""
    cache = litellm.in_memory_llm_clients_cache
    for client in list(cache.cache_dict.values()):
        close = getattr(client, "close", None)
        if callable(close) and not inspect.iscoroutinefunction(close):
            close()
    cache.flush_cache()
