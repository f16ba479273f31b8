"""`genlab generate --interactive`: load the model once, then read prompts in a loop and
stream each answer. Line editing and history come from Python's `readline` (history
kept in a file across sessions); settings change with the same validation as presets.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli import render
from cli.context import ModelFlags, load, load_scorer, settings_for
from cli.errors import fail, output_lost
from genlib.errors import GenlabError, unexpected
from genlib.settings.config import SPECS, GenerationSettings, parse_assignments, resolve_settings

if TYPE_CHECKING:
    from genlib.events import Finish
    from genlib.models.loading import LoadedModel
    from genlib.settings.presets import Preset

PROMPT = "genlab> "
CONTINUE = "....... "
BLOCK = '"""'
HISTORY_LENGTH = 1000

HELP_INTRO = "Type a prompt and press Enter; the answer streams below it."
HELP_KEYS = (
    ("multi-line", f"end a line with \\ to continue it, or put the text between {BLOCK} lines"),
    ("Ctrl-C", "stop the answer being generated (at an empty prompt: quit)"),
    ("Ctrl-D", "quit"))
HELP_COMMANDS = (
    ("/help", "this text"),
    ("/preset NAME|PATH", "use a preset (your /set and command-line settings still win)"),
    ("/set KEY=VALUE ...", "change settings, e.g. /set temperature=0.7 top_p=0.9"),
    ("/set KEY=", "back to the preset's or the default value, e.g. /set logit_bias="),
    ("/show", "every setting, where it came from, and the model's own defaults"),
    ("/set logprobs=N", "after each answer, each token's logprobs and N alternatives (0: off)"),
    ("/branch STEP TOKEN", "redo the last answer with TOKEN (text or #id) forced at STEP, "
                           "the same random draws after it; both shown side by side"),
    ("/seed N", "sampling seed for every turn (/seed off: a fresh one each turn)"),
    ("/chat on|off", "conversation mode: keep the turns, apply the chat template"),
    ("/reset", "forget the conversation's turns"),
    ("/save FILE", "write this session's prompts, outputs and settings as JSONL"),
    ("/save! FILE", "the same where FILE exists: replace it"),
    ("/quit", "leave (also /exit)"))


def print_help() -> None:
    """/help on stderr: each name beside its description, which wraps at words within
    the terminal's width (the console soft-wraps, which a terminal breaks mid-word)."""
    from rich.table import Table
    from rich.text import Text

    render.err.print(Text(HELP_INTRO), soft_wrap=False)
    for title, rows in ((None, HELP_KEYS), ("Commands:", HELP_COMMANDS)):
        if title:
            render.err.print(Text(title), soft_wrap=False)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, min_width=20)
        grid.add_column(overflow="fold")
        for name, text in rows:
            grid.add_row(Text("  " + name), Text(text))
        render.err.print(grid, soft_wrap=False)


class CommandError(GenlabError):
    """A /command used the wrong way; the session goes on."""


@dataclass
class Session:
    """Everything one interactive session keeps between turns."""

    lm: LoadedModel
    flags: dict[str, Any]  # settings given on the command line or with /set (they win)
    preset: Preset | None
    settings: GenerationSettings
    system: str | None = None
    chat: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    logprobs: int = 0  # /set logprobs=N (a view option, not a generation setting)
    last: tuple[list[int], GenerationSettings] | None = None  # for /branch
    scorer: LoadedModel | None = None  # the model --rerank MODEL scores with
    combined: dict[str, Any] = field(default_factory=dict)  # what --ensemble/--amateur imply
    backend: str = "auto"  # --backend
    saved: set[Path] = field(default_factory=set)  # files /save wrote: it may replace them


def run(flags: dict[str, Any], preset_ref: str | None, model_flags: ModelFlags, chat: bool,
        system: str | None, combined: dict[str, Any] | None = None) -> None:
    """Entry point from `genlab generate --interactive`; `combined`: the settings
    --ensemble/--amateur imply, under every preset the session takes."""
    settings, preset = settings_for(preset_ref, flags, combined)
    if system and not chat:
        raise fail("--system needs --chat")
    scorer = load_scorer(model_flags, settings)
    lm = load(model_flags, preset)
    session = Session(lm=lm, flags=dict(flags), preset=preset, settings=settings,
                      system=system, scorer=scorer, combined=dict(combined or {}),
                      backend=model_flags.backend)
    if chat:
        probe_chat(lm)  # without a template: ChatTemplateError, exit 2 (drop --chat)
        set_chat(session, "on")
    history = History.open()
    _lenient_stdin()
    render.info(f"genlab interactive · {lm.ref} · /help for commands, Ctrl-D to quit")
    try:
        code = loop(session)
    except Exception:
        rescue(session)  # whatever ended the session, the answers so far are kept
        raise
    finally:
        history.save()
    if code:
        raise typer.Exit(code)


def _lenient_stdin() -> None:
    """Read bytes that are not UTF-8 as lone surrogates instead of raising mid-line, so
    the loop can refuse that one line and the input stream stays usable."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (ValueError, OSError):
            pass  # a stream that cannot change: a bad line ends the session as EOF would


def rescue(session: Session) -> Path | None:
    """Write the session's turns to a file in the user data folder and say where;
    for a session ended by a fault no handler foresaw."""
    if not session.turns:
        return None
    import time

    from platformdirs import user_data_dir

    path = Path(user_data_dir("genlab")) / f"session-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_turns(path, session.turns)
    except OSError as exc:
        render.warn(f"cannot keep this session's {len(session.turns)} turns in {path} ({exc})")
        return None
    verb = "is" if len(session.turns) == 1 else "are"
    render.warn(f"the session ended early; its {render.counted(len(session.turns), 'turn')} "
                f"{verb} in {path}")
    return path


def loop(session: Session) -> int:
    """Read, run, repeat, until /quit, Ctrl-D or Ctrl-C at an empty prompt; the exit
    status (2: the input ended inside a prompt, which was not run)."""
    reader = PromptReader()
    while True:
        try:
            text = reader.read()
        except UnfinishedPrompt as exc:
            render.out.print()
            render.error(str(exc))
            return 2
        except EOFError:
            render.out.print()
            return 0
        except KeyboardInterrupt:
            render.out.print()
            if not reader.interrupted_text:
                return 0
            continue  # Ctrl-C on a typed line drops it, as shells do
        if not text.strip():
            continue
        if not valid_text(text):
            continue
        if text.startswith("/"):
            if not command(session, text.strip()):
                return 0
            continue
        try:
            turn(session, text)
        except GenlabError as exc:
            render.error(str(exc))
        except KeyboardInterrupt:
            render.info("[interrupted]")
        except Exception as exc:  # noqa: BLE001  (a fault in one turn never ends the session)
            if output_lost(exc):
                raise  # nowhere left to answer: the command ends (141, or one line)
            render.error(f"{unexpected(exc)} (the session goes on; GENLAB_DEBUG=1 shows "
                         f"tracebacks)")
            if os.environ.get("GENLAB_DEBUG"):
                import traceback

                traceback.print_exc()


def valid_text(text: str) -> bool:
    """Whether a typed line is Unicode text; says so when it is not (bytes that were not
    UTF-8 reach here as lone surrogates)."""
    from genlib.jsonl import first_surrogate

    bad = first_surrogate(text)
    if bad is None:
        return True
    render.error(f"that line is not valid UTF-8 (character {bad[0] + 1}); nothing was run, "
                 f"type it again")
    return False


# ---------------------------------------------------------------- reading input


class UnfinishedPrompt(EOFError):
    """The input ended inside a prompt: in a \"\"\" block or after a trailing backslash."""

    def __init__(self, lines: int, inside: str, ending: str) -> None:
        super().__init__(f"the input ended {inside}, so that prompt "
                         f"({render.counted(lines, 'line')}) was not run; {ending}")


def read_prompt(read: Any = input) -> str:
    """One prompt: a line, lines joined by a trailing backslash, or a \"\"\" block."""
    first = read(PROMPT)
    if first.strip().startswith(BLOCK):
        return _read_block(first.strip()[len(BLOCK):], read)
    lines = []
    line = first
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = _read_more(read, len(lines), "after a line ending in a backslash",
                          "end the prompt's last line without one")
    lines.append(line)
    return "\n".join(lines)


def _read_more(read: Any, typed: int, inside: str, ending: str) -> str:
    try:
        return read(CONTINUE)
    except EOFError:
        raise UnfinishedPrompt(typed, inside, ending) from None


def _read_block(rest: str, read: Any) -> str:
    if rest.rstrip().endswith(BLOCK):
        return rest.rstrip()[:-len(BLOCK)]
    lines = [rest] if rest else []
    while True:
        line = _read_more(read, len(lines), f"inside a {BLOCK} block",
                          f"close the block with {BLOCK}")
        if line.rstrip().endswith(BLOCK):
            last = line.rstrip()[:-len(BLOCK)]
            if last:
                lines.append(last)
            return "\n".join(lines)
        lines.append(line)


class PromptReader:
    """`input()` that remembers what Ctrl-C interrupted: an empty prompt (leave the
    session) or typed text (drop just that)."""

    def __init__(self) -> None:
        self.showing = PROMPT
        self.interrupted_text = ""

    def __call__(self, prompt: str) -> str:
        self.showing = prompt
        if sys.stdout.isatty():
            return input(prompt)
        # stdout carries only generated text: with it redirected, prompt on stderr.
        sys.stderr.write(prompt)
        sys.stderr.flush()
        return input()

    def read(self) -> str:
        self.interrupted_text = ""
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            return read_prompt(self)
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # readline still holds the typed line here; it clears it once the
        # KeyboardInterrupt propagates, so look now.
        typed = _line_buffer()
        self.interrupted_text = typed or ("(block)" if self.showing == CONTINUE else "")
        raise KeyboardInterrupt


def _line_buffer() -> str:
    try:
        import readline
    except ImportError:
        return ""
    return readline.get_line_buffer()


@dataclass
class History:
    """readline history, loaded from and saved to one file across sessions."""

    path: Path | None

    @staticmethod
    def file() -> Path:
        """$GENLAB_HISTORY, else `history` in the platform's user data dir."""
        env = os.environ.get("GENLAB_HISTORY")
        if env:
            return Path(env).expanduser()
        from platformdirs import user_data_dir

        return Path(user_data_dir("genlab")) / "history"

    @classmethod
    def open(cls) -> History:
        try:
            import readline
        except ImportError:  # no line editing on this platform; plain input() still works
            return cls(None)
        path = cls.file()
        readline.set_history_length(HISTORY_LENGTH)
        if path.is_file():
            try:
                readline.read_history_file(path)
            except OSError as exc:
                render.warn(f"cannot read history {path} ({exc}); starting without it")
        return cls(path)

    def save(self) -> None:
        if self.path is None:
            return
        import readline

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(self.path)
        except OSError as exc:
            render.warn(f"cannot save history to {self.path} ({exc})")


# ---------------------------------------------------------------- commands


def command(session: Session, text: str) -> bool:
    """Run one /command; False means leave the session."""
    name, _, args = text.partition(" ")
    args = args.strip()
    handlers = {"/help": print_help,
                "/preset": lambda: set_preset(session, args),
                "/set": lambda: set_values(session, args),
                "/show": lambda: show(session),
                "/branch": lambda: branch(session, args),
                "/seed": lambda: set_seed(session, args),
                "/chat": lambda: set_chat(session, args),
                "/reset": lambda: reset(session),
                "/save": lambda: save(session, args),
                "/save!": lambda: save(session, args, replace=True)}
    if name in ("/quit", "/exit"):
        return False
    handler = handlers.get(name)
    if handler is None:
        from genlib.settings.config import closest_key

        hint = closest_key(name, [*handlers, "/quit"])
        extra = f" (did you mean {hint}?)" if hint else ""
        render.error(f"unknown command {name}{extra}; /help lists them")
        return True
    try:
        handler()
    except GenlabError as exc:
        render.error(str(exc))  # nothing changed: each handler validates before it assigns
    except Exception as exc:  # noqa: BLE001  (a fault in one command never ends the session)
        render.error(f"{name}: {unexpected(exc)} (the session goes on)")
    return True


def apply(session: Session, flags: dict[str, Any], preset: Preset | None,
          source: str) -> None:
    """Resolve the new flags over the new preset; only a valid result replaces the old."""
    from genlib.sampling.processors import check_for_model

    own = preset.settings if preset else {}
    settings = resolve_settings(flags, {**session.combined, **own}, source=source,
                                presets=[own])
    check_for_model(settings, session.lm.tokenizer, session.lm.vocab_size)
    session.flags, session.preset, session.settings = flags, preset, settings
    render.warn_unused(settings)


def set_values(session: Session, args: str) -> None:
    if not args:
        raise CommandError("/set needs KEY=VALUE pairs, e.g. /set temperature=0.7")
    parts = [p for chunk in args.split(",") for p in chunk.split()]  # as parse_assignments
    views = [p for p in parts if p.startswith("logprobs=")]
    for part in views:
        value = part.partition("=")[2]
        if value and (not value.isdigit() or int(value) > 20):
            raise CommandError(f"/set {part}: logprobs takes 0-20 (logprobs= is 0, off)")
    cleared = [p[:-1] for p in parts
               if p not in views and p.endswith("=") and "=" not in p[:-1]]
    args = " ".join(p for p in parts if p not in views and p[:-1] not in cleared)
    changes: dict[str, Any] = {}
    if args or cleared:  # the settings first: logprobs changes only if they are valid
        unknown = [key for key in cleared if key not in SPECS]
        if unknown:
            raise CommandError(f"/set {unknown[0]}=: no such setting (`genlab presets keys` "
                               f"lists them)")
        changes = parse_assignments(args, "/set") if args else {}
        flags = {k: v for k, v in session.flags.items() if k not in cleared}
        apply(session, flags | changes, session.preset, "/set")
    if views:
        session.logprobs = int(views[-1].partition("=")[2] or 0)  # KEY=: the default
        render.info(f"logprobs {session.logprobs}")
    if cleared:
        render.info(f"cleared {', '.join(cleared)} (the preset's or the default value)")
    if changes:
        render.info("set " + ", ".join(f"{k}={v!r}" for k, v in changes.items()))


def set_preset(session: Session, args: str) -> None:
    from genlib.settings.presets import load_preset

    if not args:
        raise CommandError("/preset needs a preset name or a .yaml path")
    preset = load_preset(args)
    apply(session, session.flags, preset, f"/preset {args}")
    note = ""
    if preset.model and preset.model != session.lm.ref:
        note = f" (its model {preset.model} is not loaded: the session keeps {session.lm.ref})"
    render.info(f"preset {preset.name}{note}")


def set_seed(session: Session, args: str) -> None:
    if not args:
        raise CommandError("/seed needs a number, e.g. /seed 3 (/seed off: a fresh one "
                           "each turn)")
    if args in ("off", "none"):
        flags = {k: v for k, v in session.flags.items() if k != "seed"}
        apply(session, flags, session.preset, "/seed")
        render.info("seed: a fresh one each turn")
        return
    changes = parse_assignments(f"seed={args}", "/seed")
    apply(session, {**session.flags, **changes}, session.preset, "/seed")
    render.info(f"seed {changes['seed']}")


def set_chat(session: Session, args: str) -> None:
    if args not in ("on", "off"):
        raise CommandError(f"/chat takes on or off, got {args!r}")
    if args == "on":
        from genlib.errors import ChatTemplateError

        try:
            probe_chat(session.lm)
        except ChatTemplateError:
            raise CommandError(f"{session.lm.ref} has no chat template, so chat mode is not "
                               f"available; prompts go to the model as plain text") from None
    session.chat = args == "on"
    session.messages = []
    render.info(f"chat {args}")


def probe_chat(lm: LoadedModel) -> None:
    """ChatTemplateError unless the model's chat template applies to a conversation."""
    lm.encode_chat([{"role": "user", "content": "hi"}])


def reset(session: Session) -> None:
    session.messages = []
    render.info("conversation cleared")


def show(session: Session) -> None:
    """The session's model, preset and chat state, then every setting with its source
    when it is not genlab's default (set: the command line or /set; the preset file
    that set it), the model's generation_config.json value where it differs (not
    applied), and a warning for each given setting the strategy ignores."""
    from genlib.settings.provenance import CLI, DEFAULT, DERIVED, model_generation_config, sources

    preset_name = session.preset.name if session.preset else "none"
    lines = [f"model: {session.lm.ref}", f"preset: {preset_name}",
             f"chat: {'on' if session.chat else 'off'} ({len(session.messages)} messages)",
             f"logprobs: {session.logprobs}",
             "settings (unmarked: genlab's default):"]
    model_config = model_generation_config(session.lm.ref, lambda: session.lm.model)
    rows = sources(session.settings, session.flags, session.preset, model_config)
    values = session.settings.to_dict()
    for row in rows:
        notes = [] if row.source in (DEFAULT, DERIVED) else \
            ["set" if row.source == CLI else row.source]
        if row.model_value is not None and row.model_value != row.value:
            notes.append(f"model's generation_config.json: {json.dumps(row.model_value)}, "
                         "not applied")
        if row.ignored:
            notes.append(f"ignored: {row.ignored}")
        note = f"   ({'; '.join(notes)})" if notes else ""
        lines.append(f"  {row.name} = {json.dumps(values[row.name])}{note}")
    render.err.print("\n".join(lines), markup=False, highlight=False)


def branch(session: Session, args: str) -> None:
    """/branch STEP TOKEN: the last answer again with TOKEN forced at STEP (answers are
    drawn by inverse CDF, so the rerun before STEP is the answer itself)."""
    from cli import render_explain
    from cli.explain import explain_record
    from genlib.lab.explain import parse_branch

    if session.last is None:
        raise CommandError("/branch needs an answer first: type a prompt")
    step, _, token = args.partition(" ")
    ids, settings = session.last
    if settings.strategy == "beam":
        raise CommandError("/branch replays a greedy or sampled answer, and this one came "
                           "from beam search; /set strategy=greedy (or sample), answer, then "
                           "/branch")
    if settings.samples is not None:
        raise CommandError("/branch replays one drawn answer, and this one was kept from "
                           "samples drawn apart; /set samples= rerank= to draw one")
    forced = parse_branch(session.lm, step, token, settings.max_new_tokens, name="/branch",
                          limit="the answer's max_new_tokens",
                          usage="/branch needs STEP TOKEN, e.g. /branch 3 #421 (a token id) "
                                "or /branch 3 the (a text that is one token; a leading space "
                                "is tried too); STEP counts the answer's tokens from 0")
    record = explain_record(session.lm, ids, "", settings, 1, forced, session.backend)
    render_explain.show_branch(record["original"], record["branch"])


def save(session: Session, args: str, replace: bool = False) -> None:
    """/save FILE: the turns to FILE, which must not exist unless this session wrote it
    (or `replace`, /save!); written whole or not at all."""
    if not args:
        raise CommandError("/save needs a file name, e.g. /save session.jsonl")
    path = Path(args).expanduser()
    if path.is_file() and not replace and path.resolve() not in session.saved:
        raise CommandError(f"{path} exists; /save! {args} replaces it, or /save another name")
    if not path.parent.is_dir():
        raise CommandError(f"cannot write {path}: there is no folder {path.parent}")
    try:
        write_turns(path, session.turns)
    except OSError as exc:
        raise CommandError(f"cannot write {path} ({exc})") from None
    session.saved.add(path.resolve())
    render.info(f"saved {len(session.turns)} turns to {path}")


def write_turns(path: Path, turns: list[dict[str, Any]]) -> None:
    """The turns as JSON Lines (genlib.jsonl: one line each, whatever the text holds),
    renamed into place once whole: a failed write leaves what was there. A file replaced
    keeps its permissions, a new one gets open()'s (0o666 less the umask); a symbolic
    link keeps naming its file, which is the one replaced."""
    import os
    import stat

    from genlib import jsonl
    from genlib.cachedirs import written_whole

    path = path.resolve() if path.is_symlink() else path
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    with written_whole(path, mode) as fh:
        for record in turns:
            fh.write(jsonl.dumps(record))


# ---------------------------------------------------------------- one turn


def turn(session: Session, text: str) -> None:
    """Generate for one prompt, streamed; record it for /save and for chat mode."""
    from genlib.settings.config import seeded

    lm = session.lm
    settings = seeded(session.settings)  # a fresh seed each turn, reported
    if settings.num_return_sequences != 1:
        raise CommandError("the interactive session shows one answer per prompt; "
                           "/set num_return_sequences=1")
    messages = [*session.messages, {"role": "user", "content": text}]
    system = [{"role": "system", "content": session.system}] if session.system else []
    if session.chat:
        ids = lm.encode_chat([*system, *messages])
    else:
        lm.check_prompt_chars(text, settings.max_new_tokens)
        ids = lm.encode(text)
    # --truncate-prompt is not a session option: say what works here instead.
    earlier = session.chat and bool(session.messages)  # turns /reset would forget
    lm.check_fits(len(ids), settings.max_new_tokens,
                  remedy="/reset to forget the conversation's earlier turns" if earlier
                  else "shorten the prompt")
    finish = stream_answer(lm, ids, settings, session.logprobs, session.scorer,
                           session.backend)
    session.last = (ids, settings)
    if finish is None:
        return
    if session.chat:
        session.messages = [*messages, {"role": "assistant", "content": finish.text}]
    session.turns.append({
        "turn": len(session.turns) + 1, "prompt": text, "output": finish.text,
        "finish_reason": finish.reason, "prompt_tokens": finish.prompt_tokens,
        "new_tokens": finish.new_tokens, "chat": session.chat, "model": lm.ref,
        "settings": settings.to_dict(),
        # in chat mode, what the chat template was applied to (the JSON's `messages`)
        **({"messages": [*system, *messages]} if session.chat else {})})


def stream_answer(lm: LoadedModel, ids: list[int], settings: GenerationSettings,
                  logprobs: int = 0, scorer: LoadedModel | None = None,
                  backend: str = "auto") -> Finish | None:
    """Print the answer as it arrives; Ctrl-C ends it early ("interrupted"). Sampling
    draws by inverse CDF (one uniform per step) so /branch can replay the answer with
    the same draws; `logprobs` > 0 prints each token's logprobs after it. With
    `samples` (sample and rerank) the kept sample prints once chosen, its scorer
    `scorer` where `rerank` names a model."""
    from cli import render_tokens
    from genlib.decoding.detail import Detail
    from genlib.decoding.step import collect
    from genlib.events import Finish, Token
    from genlib.generate import stream

    finish: Finish | None = None
    tokens: list[Token] = []
    detail = None
    if settings.strategy != "beam":
        detail = Detail(record=bool(logprobs), logprobs=logprobs,
                        inverse_cdf=settings.do_sample)
    elif logprobs:
        render.warn("beam search keeps no per-token logprobs to show; /set logprobs=0, or "
                    "another strategy")

    def handle(event: Any) -> None:
        nonlocal finish
        if isinstance(event, Token) and event.row == 0:
            tokens.append(event)
            render.stream_text(event.text)
        elif isinstance(event, Finish) and event.row == 0:
            finish = event
            render.stream_text(event.tail)

    collect(stream(lm, [ids], settings, detail=detail, scorer=scorer,
                   backend=backend), handle)
    render.end_line()
    if logprobs and tokens and tokens[0].detail is not None:
        render_tokens.logprobs_table(lm, tokens, settings)
    if finish is not None:
        render.stats(finish.new_tokens, finish.ttft, finish.tokens_per_second, finish.reason)
        render.warn_incomplete([finish.reason], settings.max_new_tokens)
    return finish
