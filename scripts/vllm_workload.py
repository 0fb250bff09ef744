"""The workload of ``scripts/vllm_cpu_serve.sh``: prompts that outgrow vLLM's own KV cache,
sent to a running vLLM server, with what kvoffload served read from vLLM's ``/metrics``.

The workload is ``--prompts`` distinct prompts of ``--prompt-tokens`` token ids, then the
first ``--repeat`` of them again. Before it sends anything, it reads vLLM's cache size
from ``vllm:cache_config_info`` (``block_size``, ``num_gpu_blocks``) and refuses a
workload whose repeated prompts would still be in vLLM's own prefix cache: then
kvoffload could not serve anything, and the recipe would show nothing.

For each request it prints where vLLM's prompt tokens came from, as the difference of
vLLM's own counters before and after it:

- ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``: prompt tokens
  loaded by the KV connector (kvoffload);
- ``vllm:prompt_tokens_by_source_total{source="local_cache_hit"}``: served by vLLM's own
  prefix cache;
- ``vllm:prompt_tokens_by_source_total{source="local_compute"}``: computed;
- ``vllm:external_prefix_cache_hits_total`` / ``..._queries_total``: the connector's hits
  over the tokens it was asked about.

Standard library and ``prometheus_client`` (a vLLM dependency) only. Usage::

    python scripts/vllm_workload.py --port 8000 --model /path/to/model \\
        [--prompts 8] [--prompt-tokens 700] [--repeat 3] [--max-tokens 4]

Exit status 1 when the workload would fit vLLM's cache, or when kvoffload served no
prompt token of the repeated prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from prometheus_client.parser import text_string_to_metric_families

BY_SOURCE = "vllm:prompt_tokens_by_source"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries"
CACHE_INFO = "vllm:cache_config_info"
VOCAB = 500  # token ids 2..501: inside the tiny model's vocabulary of 512, past BOS and EOS


@dataclass(frozen=True)
class Counters:
    """vLLM's prompt-token counters, summed over engines and models."""

    external_kv_transfer: float = 0.0
    local_cache_hit: float = 0.0
    local_compute: float = 0.0
    external_hits: float = 0.0
    external_queries: float = 0.0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    @property
    def prompt_tokens(self) -> float:
        """Every prompt token, whatever its source."""
        return self.external_kv_transfer + self.local_cache_hit + self.local_compute


@dataclass(frozen=True)
class CacheSize:
    """vLLM's own KV cache, from ``vllm:cache_config_info``."""

    block_size: int
    num_gpu_blocks: int


def parse_counters(text: str) -> Counters:
    """The prompt-token counters of a vLLM ``/metrics`` page (Prometheus text format).

    A counter vLLM does not export counts as 0."""
    by_source: dict[str, float] = {}
    hits = queries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{BY_SOURCE}_total":
                source = sample.labels.get("source", "")
                by_source[source] = by_source.get(source, 0.0) + sample.value
            elif sample.name == f"{EXTERNAL_HITS}_total":
                hits += sample.value
            elif sample.name == f"{EXTERNAL_QUERIES}_total":
                queries += sample.value
    return Counters(
        external_kv_transfer=by_source.get("external_kv_transfer", 0.0),
        local_cache_hit=by_source.get("local_cache_hit", 0.0),
        local_compute=by_source.get("local_compute", 0.0),
        external_hits=hits,
        external_queries=queries,
    )


def parse_cache_size(text: str) -> CacheSize:
    """vLLM's block size and block count, from the ``vllm:cache_config_info`` gauge."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CACHE_INFO:
                labels = sample.labels
                try:
                    return CacheSize(int(labels["block_size"]), int(labels["num_gpu_blocks"]))
                except (KeyError, ValueError) as exc:
                    msg = f"{CACHE_INFO} has no usable block_size/num_gpu_blocks: {labels}"
                    raise ValueError(msg) from exc
    msg = f"no {CACHE_INFO} in the metrics (is vLLM started with --disable-log-stats?)"
    raise ValueError(msg)


def make_prompts(count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids, distinct from their first token on."""
    return [[(p * 131 + i * 7) % VOCAB + 2 for i in range(tokens)] for p in range(count)]


def check_outgrows(cache: CacheSize, *, prompts: int, prompt_tokens: int, repeat: int) -> None:
    """Raise ``ValueError`` unless the prompts sent after the first ``repeat`` ones fill
    vLLM's cache, so that vLLM's own prefix cache has evicted those ``repeat`` by the time
    they come again and only kvoffload can serve them.

    vLLM keeps one block of its pool back (the null block); a prompt's full blocks are
    what a prefix cache holds of it.
    """
    if not 0 < repeat <= prompts:
        msg = f"repeat={repeat}: want 1 to prompts={prompts}"
        raise ValueError(msg)
    full = prompt_tokens // cache.block_size
    if full == 0:
        msg = (
            f"prompt_tokens={prompt_tokens} is shorter than one block of "
            f"{cache.block_size} tokens: no prefix cache can serve it"
        )
        raise ValueError(msg)
    usable = cache.num_gpu_blocks - 1
    after = (prompts - repeat) * full
    if after < usable:
        msg = (
            f"the workload fits vLLM's own KV cache ({cache.num_gpu_blocks} blocks of "
            f"{cache.block_size} tokens, {usable} usable): the {prompts - repeat} prompts "
            f"sent after the first {repeat} take {after} blocks, so vLLM's own prefix "
            f"cache still holds the repeated ones and kvoffload has nothing to serve; "
            f"lower --num-gpu-blocks-override or send more or longer prompts"
        )
        raise ValueError(msg)


def describe(label: str, prompt_tokens: int, delta: Counters) -> str:
    """One line: where a request's prompt tokens came from."""
    return (
        f"{label}: {prompt_tokens} prompt tokens: "
        f"{delta.external_kv_transfer:.0f} loaded by kvoffload, "
        f"{delta.local_cache_hit:.0f} from vLLM's prefix cache, "
        f"{delta.local_compute:.0f} computed"
    )


def summary(first: Counters, again: Counters) -> list[str]:
    """The figures of both passes, under vLLM's metric names."""
    lines = []
    for name, delta in (("first pass", first), ("repeated prompts", again)):
        lines.append(
            f"{name}: vllm:prompt_tokens_by_source_total"
            f'{{source="external_kv_transfer"}} +{delta.external_kv_transfer:.0f}, '
            f"vllm:external_prefix_cache_hits_total +{delta.external_hits:.0f} "
            f"(of +{delta.external_queries:.0f} queried)"
        )
    return lines


class Server:
    """A vLLM OpenAI-compatible server on 127.0.0.1."""

    def __init__(self, port: int, model: str) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.model = model

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as reply:
            text: str = reply.read().decode()
        return text

    def complete(self, prompt: Sequence[int], max_tokens: int) -> int:
        """Send one completion; the prompt tokens vLLM counted."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens}
        request = urllib.request.Request(
            f"{self.base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            usage = json.load(reply)["usage"]
        return int(usage["prompt_tokens"])


def counted(
    scrape: Callable[[], str], before: Counters, prompt_tokens: int, *, wait_s: float = 10.0
) -> Counters:
    """The counters once vLLM has counted ``prompt_tokens`` more prompt tokens since
    ``before`` (vLLM's server answers a request before it records its statistics)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = parse_counters(scrape())
        if (now - before).prompt_tokens >= prompt_tokens or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def run(server: Server, *, prompts: int, prompt_tokens: int, repeat: int, max_tokens: int) -> int:
    """Send the workload, print where each prompt's tokens came from; the exit status."""
    page = server.metrics()
    cache = parse_cache_size(page)
    print(
        f"vLLM's own KV cache: {cache.num_gpu_blocks} blocks of {cache.block_size} tokens; "
        f"workload: {prompts} prompts of {prompt_tokens} tokens "
        f"({prompt_tokens // cache.block_size} full blocks each), then the first {repeat} again"
    )
    try:
        check_outgrows(cache, prompts=prompts, prompt_tokens=prompt_tokens, repeat=repeat)
    except ValueError as exc:
        print(f"vllm_workload: {exc}", file=sys.stderr)
        return 1
    texts = make_prompts(prompts, prompt_tokens)
    start = now = parse_counters(page)
    passes = [
        [(f"prompt {p}", texts[p]) for p in range(prompts)],
        [(f"prompt {p} again", texts[p]) for p in range(repeat)],
    ]
    marks = [start]
    for requests in passes:
        for label, prompt in requests:
            sent = server.complete(prompt, max_tokens)
            after = counted(server.metrics, now, sent)
            print(describe(label, sent, after - now))
            now = after
        marks.append(now)
    first, again = marks[1] - marks[0], marks[2] - marks[1]
    for line in summary(first, again):
        print(line)
    if again.external_kv_transfer <= 0:
        print(
            "vllm_workload: kvoffload served no prompt token of the repeated prompts",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    return run(
        Server(args.port, args.model),
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        repeat=args.repeat,
        max_tokens=args.max_tokens,
    )


if __name__ == "__main__":
    sys.exit(main())
