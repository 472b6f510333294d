"""A stand-in judge to try a judged run offline: an OpenAI-compatible chat-completions endpoint on
127.0.0.1 that grades by a rule instead of a model.

    python examples/judge/rule_judge.py --port 8311

and in the run config, ``judge: {model: rule, base_url: http://127.0.0.1:8311/v1, scale: [0, 10]}``.

The rule: the rubric item quotes letters ('e'); the reply's score is the share of its letters that are
quoted ones, from 0 to 10, as ``<score>N</score>`` (an empty reply scores 0). Asked to compare two
replies (``judge.mode: pairwise``), it prefers the one with the larger share. It reads the rubric and the
reply from polyrl's judge prompt (its <rubric> and <reply> sections), so it answers exactly what a model
judge would be asked.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def section(prompt: str, tag: str) -> str:
    found = re.search(rf"<{tag}>\n?(.*?)\n?</{tag}>", prompt, re.DOTALL)
    return found.group(1) if found else ""


def share(reply: str, rubric: str) -> float:
    quoted = set("".join(re.findall(r"'([a-z])'", rubric.lower())))
    letters = [c for c in reply.lower() if c.isalpha()]
    return sum(c in quoted for c in letters) / len(letters) if letters else 0.0


def grade(prompt: str) -> str:
    """A verdict on polyrl's judge prompt: a score, or for a pairwise prompt the reply preferred."""
    rubric = section(prompt, "rubric")
    if "<reply_a>" in prompt:
        a, b = share(section(prompt, "reply_a"), rubric), share(section(prompt, "reply_b"), rubric)
        preferred = "A" if a > b else "B" if b > a else "tie"
        return f"Quoted letters: A {a:.0%}, B {b:.0%}. <preferred>{preferred}</preferred>"
    value = share(section(prompt, "reply"), rubric)
    return f"The reply's letters are {value:.0%} quoted ones. <score>{10 * value:.1f}</score>"


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the http.server interface
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if not self.path.endswith("/chat/completions"):
            self.send_error(404)
            return
        verdict = grade(body["messages"][-1]["content"])
        answer = json.dumps({"object": "chat.completion", "model": body.get("model", "rule"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": verdict}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8311)
    ThreadingHTTPServer.request_queue_size = 256  # a step's calls arrive at once
    server = ThreadingHTTPServer(("127.0.0.1", parser.parse_args().port), Handler)
    print(f"rule judge running on http://127.0.0.1:{server.server_port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
