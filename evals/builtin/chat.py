"""Plain conversational turns for the built-in model: short questions answered in text, ending the turn.

The agent sessions teach the model one shape of turn (THOUGHT text, then a ``bash`` call). A client that asks
something plain (a greeting, a short question) under its own prompt needs the other shape: a short text answer
followed by ``<|im_end|>``. :func:`chat_conversations` generates such conversations from templates, seeded: varied
system prompts (generic and coding-CLI style), with no tools, the ``bash`` tool or a set of several tools, the
context blocks CLIs wrap around a request (date, working folder, sandbox notes), one or two exchanges, and — when a
shell tool is offered and the request is about the machine — a tool call, its result, then a text answer that
reads the result. Answers are computed or looked up, never filler: arithmetic is done, words are reversed.

:func:`assistant_mask_spans` gives the character spans of the assistant turns, so training can score only them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from freetoken_agent.evals.builtin.template import BASH_TOOL

Message = dict[str, Any]

NAMES = ["Ada", "Quill", "Pilot", "Otter", "Juniper", "Beacon", "Marlin", "Sage", "Comet", "Nova"]
MAKERS = ["a small open-source team", "the FreeToken project", "Example Labs", "a research group", "Acme Tools"]

SYSTEM_PROMPTS = [
    "You are an assistant. Answer briefly and clearly.",
    "You are a friendly assistant. Keep replies short.",
    "You are a concise, accurate assistant.",
    "You are a coding assistant running in a terminal. Be brief.",
    "You are a command-line helper for software developers. Answer in one or two sentences.",
    "You help users with programming questions. Prefer short, direct answers.",
    "You are a pair programmer. Answer questions directly; only run commands when the user asks about the machine.",
    "You are a software engineering agent working in the user's repository. For plain questions, just answer.",
    "Act as a helpful AI. Do not make things up. Keep it short.",
    "You are a polite support bot. Reply in plain text.",
    "You are a terminal coding agent. Reply concisely; use tools only when needed.",
    "Answer the user's question. Be short and correct.",
    "You are an AI model serving a developer tool. Respond plainly, without markdown headings.",
    "You are a careful assistant that writes short answers.",
    "You are a code review assistant. Keep every answer brief.",
    "You are a shell companion: you can run commands, but greetings and questions get a direct reply.",
    "You assist engineers inside their editor. Be direct and friendly.",
    "You are a minimal assistant. One short paragraph at most.",
    "You are a teaching assistant for a programming course. Answer simply.",
    "You are a general-purpose assistant. Be helpful and brief.",
    "You are an agent that edits code and runs commands in a sandbox. When no action is needed, reply in text.",
    "Respond to the user in a helpful, short way.",
]

# Context blocks that CLIs add around a request (our own wording, several shapes).
DATES = ["2025-03-14", "2024-11-02", "2026-07-21", "March 3, 2025", "2026-01-09", "Tuesday, 2025-06-10"]
FOLDERS = ["/home/dev/project", "/workspace/app", "/tmp/work", "/srv/repo", "/Users/sam/code/site", "/home/user/src"]


def _context_prefix(rng: random.Random) -> str:
    date, folder = rng.choice(DATES), rng.choice(FOLDERS)
    return rng.choice([
        f"<context>\nToday's date: {date}.\n</context>\n\n",
        f"<system-reminder>\nSome context that may help: the date is {date}. Ignore it unless it matters for the "
        f"request.\n</system-reminder>\n\n",
        f"[session] date={date} cwd={folder}\n\n",
        f"<info>\n# date\n{date}\n\nOnly use this if it is relevant.\n</info>\n\n",
        f"Note: the working folder is {folder}.\n\n",
    ])


def _context_turn(rng: random.Random) -> str:
    date, folder = rng.choice(DATES), rng.choice(FOLDERS)
    shell = rng.choice(["bash", "zsh", "sh"])
    return rng.choice([
        f"<environment>\n  <cwd>{folder}</cwd>\n  <shell>{shell}</shell>\n  <date>{date}</date>\n</environment>",
        f"<env_info>\n  <working_directory>{folder}</working_directory>\n  <os>linux</os>\n  <today>{date}</today>\n"
        f"  <sandbox><mode>read-only</mode><network>off</network></sandbox>\n</env_info>",
        f"Environment: cwd {folder}, shell {shell}, date {date}.",
    ])


def _extra_system(rng: random.Random) -> str:
    skills = rng.sample(["pdf-reader: read PDF files", "image-tools: resize and crop images",
                         "docs-search: search library docs", "release-notes: draft release notes",
                         "sql-helper: explain SQL queries", "git-helper: summarize git history"], k=rng.randint(2, 4))
    listing = "\n".join(f"- {s} (file: skills/{s.split(':')[0]}/SKILL.md)" for s in skills)
    return rng.choice([
        f"<skills>\n## Skills\nA skill is a folder of instructions. Open its SKILL.md only when a task needs it.\n"
        f"{listing}\n</skills>",
        "<sandbox>\nFiles may only be read, not written. Network access is disabled. Commands that need more are "
        "refused.\n</sandbox>",
        f"<skills>\n{listing}\n</skills><permissions>\nThe sandbox is read-only. Approval policy: never ask.\n"
        f"</permissions>",
        "Guidelines: keep answers short; do not run commands for questions you can answer directly.",
    ])


# ----------------------------------------------------------------------------------------------------- tools

def _tool(name: str, description: str, props: dict[str, Any], required: list[str], strict: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if strict:
        params["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def _s(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


SHELL_TOOLS: list[tuple[str, str, str]] = [  # (tool name, argument name, description)
    ("bash", "command", "Run one bash command and return its exit status and output."),
    ("shell", "command", "Runs a shell command and returns its output."),
    ("exec_command", "cmd", "Runs a command in a terminal session and returns its output or a session id."),
    ("run_command", "cmd", "Execute a command line in the workspace."),
    ("terminal", "command", "Run a command in the user's terminal; output is returned when it exits."),
    ("Bash", "command", "Executes a given bash command with an optional timeout."),
]

OTHER_TOOLS: list[dict[str, Any]] = [
    _tool("apply_patch", "Apply a patch to files in the workspace. The patch uses the unified diff format; paths "
          "are relative to the working folder.", {"input": _s("The patch text.")}, ["input"], True),
    _tool("read_file", "Read a text file and return its content with line numbers.",
          {"path": _s("Path of the file."), "offset": {"type": "number", "description": "First line to read."},
           "limit": {"type": "number", "description": "How many lines to read."}}, ["path"], False),
    _tool("write_file", "Write content to a file, replacing it.",
          {"path": _s("Path of the file."), "content": _s("The new content.")}, ["path", "content"], True),
    _tool("list_dir", "List the entries of a folder.", {"path": _s("The folder.")}, ["path"], False),
    _tool("grep", "Search files for a regular expression and return matching lines.",
          {"pattern": _s("The regular expression."), "path": _s("Folder or file to search."),
           "glob": _s("Only files matching this glob.")}, ["pattern"], False),
    _tool("write_stdin", "Writes characters to a running terminal session and returns recent output.",
          {"session_id": {"type": "number", "description": "The session."},
           "chars": _s("Bytes to write; empty polls without writing."),
           "yield_time_ms": {"type": "number", "description": "How long to wait for output."}}, ["session_id"], True),
    _tool("view_image", "View a local image file when visual inspection is needed.",
          {"path": _s("Local path to an image file.")}, ["path"], True),
    _tool("web_fetch", "Fetch a URL and return its text.", {"url": _s("The address."),
          "max_chars": {"type": "number", "description": "Truncate the text to this many characters."}}, ["url"], False),
    _tool("update_plan", "Update the task plan shown to the user. Each step has a status: pending, in_progress or "
          "completed. Use it for multi-step work only.",
          {"explanation": _s("Why the plan changed."),
           "plan": {"type": "array", "items": {"type": "object", "properties": {
               "step": _s("The step."), "status": _s("pending, in_progress or completed.")},
               "required": ["step", "status"]}}}, ["plan"], True),
    _tool("ask_user", "Ask the user one to three short questions and wait for the answers. Only available in "
          "planning mode.", {"questions": {"type": "array", "description": "The questions.", "items": {
              "type": "object", "properties": {"id": _s("Stable identifier."), "question": _s("The question."),
                                               "options": {"type": "array", "items": _s("A choice.")}},
              "required": ["id", "question"]}}}, ["questions"], True),
    _tool("todo_write", "Create and manage a structured task list for the current session.",
          {"todos": {"type": "array", "items": {"type": "object", "properties": {
              "content": _s("The task."), "status": _s("pending, in_progress or completed.")}}}}, ["todos"], False),
]


DETAILS = [
    "Output longer than the limit is truncated from the middle.",
    "Paths are relative to the working folder unless absolute.",
    "Prefer this over running an equivalent shell command.",
    "Fails with a clear error when the target does not exist.",
    "Long-running work keeps going in the background; poll it for more output.",
    "Requests outside the sandbox need the user's approval.",
    "Do not use it to read secrets or credentials.",
    "Results are returned as plain text.",
]


def _verbose(tool: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """``tool`` with a longer description (clients' tool specs are often several sentences each)."""
    function = dict(tool["function"])
    function["description"] = " ".join([function["description"], *rng.sample(DETAILS, k=rng.randint(2, 5))])
    return {"type": "function", "function": function}


def _shell_tool(rng: random.Random) -> tuple[dict[str, Any], str, str]:
    name, arg, description = rng.choice(SHELL_TOOLS)
    if name == "bash" and arg == "command" and rng.random() < 0.5:
        return BASH_TOOL, "bash", "command"
    props: dict[str, Any] = {arg: _s("The command to run.")}
    if rng.random() < 0.6:
        props["workdir"] = _s("Working folder; defaults to the current one.")
    if rng.random() < 0.6:
        props["timeout_ms"] = {"type": "number", "description": "Stop the command after this many milliseconds."}
    if rng.random() < 0.3:
        props["justification"] = _s("Why the command needs more permissions; omit otherwise.")
    return _tool(name, description, props, [arg], rng.random() < 0.5), name, arg


# ------------------------------------------------------------------------------------------ questions, answers

QA = Callable[[random.Random], tuple[str, str]]


def _pick(rng: random.Random, pairs: list[tuple[list[str], list[str]]]) -> tuple[str, str]:
    asks, answers = rng.choice(pairs)
    return rng.choice(asks), rng.choice(answers)


GREETINGS: list[tuple[list[str], list[str]]] = [
    (["Hello!", "Hello", "hello", "Hello there!", "Hey", "hey!", "Hi!", "hi", "Hi there.", "Good morning!",
      "Good evening.", "Greetings!", "Howdy!", "Hey there, how's it going?", "Yo!"],
     ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hey! What are we working on?",
      "Hello. What would you like to do?", "Hi there! How can I help?", "Good to see you. What do you need?"]),
    (["Say hello.", "Please say hello.", "Greet me.", "Say hello to me!", "Just greet me back.",
      "Reply with a short greeting.", "Write a one-line greeting.", "Can you say hello?", "Greet the user."],
     ["Hello!", "Hello! Nice to meet you.", "Hi! Good to meet you.", "Hello there!", "Hello! How can I help?"]),
    (["Say good morning.", "Wish me a good morning."], ["Good morning!", "Good morning! Have a great day."]),
    (["Say hello in French.", "How do you say hello in Spanish?"], ["Bonjour !", "In French: bonjour.",
                                                                     "Hola (Spanish) or bonjour (French)."]),
    (["How are you?", "How are you doing today?", "What's up?", "How's it going?"],
     ["I'm doing well, thanks. How can I help?", "All good here. What can I do for you?",
      "Ready to help. What's on your mind?"]),
    (["Who are you?", "What are you?", "What can you do?", "Introduce yourself.", "What is your name?"],
     ["I'm an AI assistant. I can answer questions, explain code and help with small tasks.",
      "I'm a small language model that helps with questions and coding tasks.",
      "I'm an assistant for programming questions and everyday tasks. Ask me anything."]),
    (["Thanks!", "Thank you.", "Thanks, that's all.", "Great, thank you!", "Perfect, thanks."],
     ["You're welcome!", "Glad I could help.", "Any time. Let me know if you need anything else."]),
    (["Bye!", "Goodbye.", "See you later.", "That's all for today."],
     ["Goodbye!", "See you! Have a good day.", "Bye! Come back any time."]),
    (["ping", "Test.", "test", "Are you there?", "Can you hear me?", "Is this working?"],
     ["Pong! I'm here.", "Yes, I'm here. What do you need?", "It works. How can I help?"]),
]

FACTS: list[tuple[str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "Tokyo is the capital of Japan."),
    ("What is the capital of Italy?", "Rome."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Germany?", "Berlin is the capital of Germany."),
    ("What is the capital of Spain?", "Madrid."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("How many minutes are in an hour?", "An hour has 60 minutes."),
    ("What color is the sky on a clear day?", "Blue."),
    ("What is the boiling point of water?", "Water boils at 100 °C (212 °F) at sea level."),
    ("What does CPU stand for?", "CPU stands for central processing unit."),
    ("What does HTTP stand for?", "HyperText Transfer Protocol."),
    ("What does JSON stand for?", "JSON stands for JavaScript Object Notation."),
    ("What does SQL stand for?", "Structured Query Language."),
    ("What does API mean?", "API means application programming interface: the way programs talk to each other."),
    ("What does GPU stand for?", "GPU stands for graphics processing unit."),
    ("What is git?", "Git is a version control system: it records changes to files so you can review and undo them."),
    ("What is Python?", "Python is a popular general-purpose programming language."),
    ("What does `len` do in Python?", "`len(x)` returns the number of items in `x`."),
    ("How do I reverse a list in Python?", "Use `items[::-1]` for a reversed copy, or `items.reverse()` in place."),
    ("How do I print something in Python?", "Call `print`, for example `print(\"hello\")`."),
    ("How do I create a new git branch?", "Run `git switch -c my-branch` (or `git checkout -b my-branch`)."),
    ("How do I see the files in a folder?", "Use `ls` (or `ls -la` to include hidden files and details)."),
    ("What is a function?", "A function is a named block of code that takes inputs and returns a result."),
    ("What is recursion?", "Recursion is when a function calls itself to solve smaller parts of a problem."),
    ("What is an MoE model?", "A mixture-of-experts model routes each token to a few expert networks instead of "
     "running all of them."),
    ("What is a unit test?", "A unit test checks that one small piece of code behaves as expected."),
    ("What's the difference between a list and a tuple in Python?", "A list can be changed; a tuple cannot."),
    ("What is a dictionary in Python?", "A dictionary maps keys to values, like `{\"a\": 1}`."),
    ("What does `git status` do?", "It shows which files changed and which changes are staged."),
    ("Which command shows the current folder?", "`pwd` prints the current working folder."),
    ("What is the opposite of hot?", "Cold."),
    ("Is Python compiled or interpreted?", "CPython compiles to bytecode and interprets it, so usually "
     "\"interpreted\"."),
    ("Name a primary color.", "Red."),
    ("Give me a name for a cat.", "How about Miso?"),
    ("Suggest a variable name for a user's age.", "`user_age`."),
    ("Write a Python one-liner that adds two numbers.", "`add = lambda a, b: a + b`"),
    ("Write a haiku about code.", "Quiet lines compile,\nthe tests turn green one by one,\nmorning coffee cools."),
    ("Tell me a short joke.", "Why do programmers prefer dark mode? Because light attracts bugs."),
    ("Can you help me?", "Of course. What do you need help with?"),
    ("I have a question.", "Sure, go ahead."),
    ("Are you ready?", "Yes, ready when you are."),
]

WORDS = ["cat", "river", "python", "code", "table", "green", "music", "window", "rocket", "apple", "stone", "cloud"]


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    ask = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?", f"Quick: {a}{op}{b}"])
    return ask, rng.choice([f"{a} {op} {b} = {value}.", f"{value}.", f"It's {value}."])


def _word_task(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice([f"Spell '{word}' backwards.", f"Reverse the word {word}."]), f"{word[::-1]}"
    if kind == 1:
        return f"Convert '{word}' to uppercase.", word.upper()
    if kind == 2:
        return f"How many letters are in the word '{word}'?", f"'{word}' has {len(word)} letters."
    n = rng.randint(3, 7)
    return f"Count to {n}.", ", ".join(str(i) for i in range(1, n + 1)) + "."


def _prime(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 99)
    prime = all(n % d for d in range(2, int(n ** 0.5) + 1))
    return f"Is {n} a prime number?", (f"Yes, {n} is prime." if prime else f"No, {n} is not prime.")


def _fact(rng: random.Random) -> tuple[str, str]:
    ask, answer = rng.choice(FACTS)
    if rng.random() < 0.2:
        ask = ask[0].lower() + ask[1:]
    if rng.random() < 0.15:
        ask = rng.choice(["Quick question: ", "Hey, ", "Please answer: "]) + ask
    return ask, answer


QUESTIONS: list[tuple[QA, float]] = [
    (lambda rng: _pick(rng, GREETINGS), 0.35), (_fact, 0.35), (_arithmetic, 0.1), (_word_task, 0.1), (_prime, 0.1)]

# Requests about the machine: (request, command, fake output, answer from the output).
MACHINE: list[tuple[str, str, str, str]] = [
    ("What files are in this folder?", "ls", "README.md\nmain.py\ntests", "The folder has README.md, main.py and a "
     "tests folder."),
    ("List the files here.", "ls", "app.py\nrequirements.txt", "There are two files: app.py and requirements.txt."),
    ("Which Python version is installed?", "python3 --version", "Python 3.11.4", "Python 3.11.4 is installed."),
    ("What folder am I in?", "pwd", "/home/dev/project", "You are in /home/dev/project."),
    ("What is the current git branch?", "git branch --show-current", "main", "The current branch is main."),
    ("How many lines does main.py have?", "wc -l main.py", "42 main.py", "main.py has 42 lines."),
    ("Is node installed?", "node --version", "bash: node: command not found", "No, node is not installed here."),
    ("What does the README say?", "cat README.md", "# demo\nA tiny demo project.", "The README describes a tiny "
     "demo project called demo."),
    ("Show the last commit.", "git log -1 --oneline", "3f2a1c9 Fix typo in docs", "The last commit is 3f2a1c9, "
     "\"Fix typo in docs\"."),
    ("Run the tests.", "python -m pytest -q", "5 passed in 0.12s", "All 5 tests passed."),
    ("Check the disk usage of this folder.", "du -sh .", "1.2M\t.", "The folder uses 1.2 MB."),
]


def _call(name: str, arg: str, command: str, index: int) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": {arg: command}}}


def chat_conversation(rng: random.Random) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """One conversation ``(messages, tools)`` whose last turn is a plain assistant answer (no tool call)."""
    system = rng.choice(SYSTEM_PROMPTS)
    if rng.random() < 0.3:
        system = f"You are {rng.choice(NAMES)}, an assistant made by {rng.choice(MAKERS)}.\n\n{system}"
    kind = rng.random()
    tools, shell = None, None
    if kind < 0.3:
        tool, name, arg = _shell_tool(rng)
        tools, shell = [tool], (name, arg)
    elif kind < 0.65:
        tool, name, arg = _shell_tool(rng)
        tools, shell = [tool, *rng.sample(OTHER_TOOLS, k=rng.randint(1, len(OTHER_TOOLS)))], (name, arg)
        rng.shuffle(tools)
        if rng.random() < 0.4:
            tools = [_verbose(t, rng) for t in tools]
    messages: list[Message] = [] if rng.random() < 0.05 else [{"role": "system", "content": system}]
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": _extra_system(rng)})
    if rng.random() < 0.25:
        messages.append({"role": "user", "content": _context_turn(rng)})
    prefix = _context_prefix(rng) if rng.random() < 0.3 else ""
    for turn in range(rng.choice([1, 1, 1, 2])):
        if shell is not None and rng.random() < 0.2:
            ask, command, output, answer = rng.choice(MACHINE)
            messages.append({"role": "user", "content": prefix + ask})
            index = len(messages)
            messages.append({"role": "assistant", "content": rng.choice(["", "", "Let me check."]),
                             "tool_calls": [_call(*shell, command, index)]})
            messages.append({"role": "tool", "tool_call_id": f"call_{index}", "content": output})
            messages.append({"role": "assistant", "content": answer})
        else:
            fn = rng.choices([q for q, _ in QUESTIONS], weights=[w for _, w in QUESTIONS])[0]
            ask, answer = fn(rng)
            messages.append({"role": "user", "content": prefix + ask})
            messages.append({"role": "assistant", "content": answer})
        prefix = ""
    return messages, tools


_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def assistant_mask_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of every assistant turn's content in rendered text, each ending after its ``<|im_end|>``."""
    return [(m.start(1), m.end(1)) for m in _ASSISTANT.finditer(text)]
