"""The training commands' command line: ``--config`` (the entry point's
``get_config()``, a file of the user's held against it, ``--config.KEY=VALUE``
overrides), ``--workdir`` and ``--help``, each mistake refused in one line;
then :func:`cli` runs :func:`experiments.elastic.main`."""
from __future__ import annotations

import copy
import difflib
import os
import re
import sys
import textwrap
from typing import Sequence

import ml_collections

from experiments import config_keys, elastic
from experiments.elastic import ConfigError, _log, expand_user_paths  # noqa: PLC2701
from pipejax import distributed


HELP_FLAGS = ('-h', '--help', '--helpfull')


def usage(config, config_file: str, require_workdir: bool = False,
          extra_flags: Sequence[tuple[str, str]] = ()) -> str:
  """``--help``: the command's description (its module's docstring), its
  flags (``extra_flags``: a command's own, ``(flag, what it does)``) and
  every config key with the value this command line gives it."""
  main_module = sys.modules.get('__main__')
  spec = getattr(main_module, '__spec__', None)
  command = (f'python -m {spec.name}' if spec is not None and spec.name
             else f'python {sys.argv[0]}')
  workdir = '--workdir=DIR' if require_workdir else '[--workdir=DIR]'
  own = ''.join(f' [{flag}]' for flag, _ in extra_flags)
  lines = [f'usage: {command} {workdir}{own} [--config=FILE] [--config.KEY=VALUE ...]']
  doc = (getattr(main_module, '__doc__', None) or '').strip()
  if doc:
    lines += ['', doc]
  lines += ['', 'flags:',
            '  --workdir=DIR   output directory' + (
                '' if require_workdir else ' (default: a fresh folder under ./runs/)'),
            f'  --config=FILE   a config file with get_config() (default: '
            f'{os.path.relpath(config_file)})',
            *(f'  {flag:<15} {what}' for flag, what in extra_flags),
            '', 'config keys (--config.KEY=VALUE) and their values on this command line:']
  for name, value in config_keys.flat(config):
    lines.append(f'  --config.{name}={config_keys.shown(value)}')
    meaning = config_keys.MEANINGS.get(name)
    if meaning:
      lines += textwrap.wrap(meaning, 88, initial_indent=' ' * 6, subsequent_indent=' ' * 6)
  lines += ['', 'every key, its defaults and meaning: docs/config.md']
  return '\n'.join(lines)


def _absent_keys(keys: list[str], argv: list[str], config_file: str) -> list[str]:
  """Those of ``keys`` (dotted) that the configuration does not have: the
  ``--config`` file's, else ``config_file``'s (empty when it cannot be read)."""
  try:
    config = _load_config_file(_config_file_argument(argv)[0] or config_file)
  except Exception:  # noqa: BLE001 - then no key is named
    return []
  absent = []
  for key in keys:
    node = config
    try:
      for part in key.split('.'):
        node = node[part]
    except (KeyError, TypeError, AttributeError):
      absent.append(key)
  return absent


def _command_line_error(error: Exception, argv: list[str], config_file: str) -> str:
  """One line for a command line that absl or ml_collections refused:
  an unknown config key by its full name (they name only its last part)."""
  if error.args and isinstance(error.args[0], KeyError):  # a key below the top, wrapped
    error = error.args[0]
  # A KeyError's str() is the repr of its message: read the message itself.
  message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
  lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
  if isinstance(error, SyntaxError):
    return f'cannot load the --config file: {type(error).__name__}: {lines[0]}'
  if any('config file' in line or 'earlier failure to load' in line for line in lines):
    why = lines[-1].split('earlier failure to load: ')[-1]  # the last line says why
    return f'cannot load the --config file: {why}'
  detail = lines[0] if lines else type(error).__name__
  if 'before a value for --config was specified' in detail:
    return f'bad command line: {detail}; put --config FILE before the --config.KEY overrides'
  name = detail.strip('\'"')
  if isinstance(error, KeyError) or (name.isidentifier() and name != detail):
    keys = [a.split('=', 1)[0][len('--config.'):] for a in argv[1:]
            if a.startswith('--config.')]
    named = _absent_keys([k for k in keys if name in k.split('.')], argv, config_file)
    if named:
      # ml_collections suggests a near name for the key's last part it could not find.
      near = next((re.match(r'Did you mean "([^"]+)"', line) for line in lines[1:]
                   if line.startswith('Did you mean')), None)
      parts = named[0].split('.')
      if near and name in parts:  # the deepest part so named (data.data: the second)
        parts[len(parts) - 1 - parts[::-1].index(name)] = near.group(1)
        return (f'unknown config key {named[0]!r} (did you mean {".".join(parts)!r}? '
                f'--help lists the keys)')
      near = difflib.get_close_matches(
          named[0], [key for key, _ in config_keys.flat(_load_config_file(config_file))], n=1)
      if near:
        return f'unknown config key {named[0]!r} (did you mean {near[0]!r}? --help lists the keys)'
      return f'unknown config key {named[0]!r} (--help lists the keys)'
  return (f'bad command line: {detail} (a config key that does not exist, or a value of the '
          f'wrong type; --help lists the keys)')


def parse_command_line(config_file: str, argv=None, require_workdir: bool = False,
                       extra_flags: Sequence[tuple[str, str]] = ()):
  """``--config`` (``config_file`` by default, with overrides) and
  ``--workdir`` (``require_workdir``: it must be given, as the benchmarks
  need); returns ``(config, workdir)``, or None after printing a one-line
  error. ``--help`` prints :func:`usage` (with ``extra_flags``, the flags the
  caller takes out of ``argv`` itself) and exits 0."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415
  argv = list(sys.argv if argv is None else argv)
  wants_help = any(a in HELP_FLAGS for a in argv[1:])
  if wants_help:
    argv = argv[:1] + [a for a in argv[1:] if a not in HELP_FLAGS]
  given, without = _config_file_argument(argv)
  missing = {}  # the keys a user's --config file lacks (their defaults), said once the
  # overrides apply
  try:
    if given is None or os.path.realpath(given) == os.path.realpath(config_file):
      # Defining the flag already reads the command line (to load the file).
      config_flags.DEFINE_config_file('config', config_file, 'the run configuration',
                                      lock_config=True, sys_argv=argv)
    else:
      # A file of the user's, completed with the command's keys before the
      # overrides apply: an override may name a key the file lacks.
      argv = without
      config_flags.DEFINE_config_dict('config', _user_config_file(given, config_file, missing),
                                      'the run configuration', lock_config=True, sys_argv=argv)
    flags.DEFINE_string('workdir', None, 'output directory (default: ./runs/<fresh>)')
    rest = flags.FLAGS(argv)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return None
  except Exception as e:  # noqa: BLE001 - absl and ml_collections raise many types
    print(f'error: {_command_line_error(e, argv, config_file)}', file=sys.stderr)
    return None
  try:
    flags.FLAGS.config.keys  # noqa: B018 - a --config file that failed to load raises here
  except Exception as e:  # noqa: BLE001 - the file: missing, a directory, unreadable
    print(f'error: {_command_line_error(e, argv, config_file)}', file=sys.stderr)
    return None
  loaded = config_flags.get_config_filename(flags.FLAGS['config'])  # the dict, for a user's
  try:
    if isinstance(loaded, str) and os.path.realpath(loaded) != os.path.realpath(config_file):
      # a file named another way (a --flagfile): held against the keys all the same
      _hold_against(flags.FLAGS.config, loaded, config_file)
      _check_kinds(flags.FLAGS.config, loaded, config_file)
    elif given is not None and os.path.realpath(given) != os.path.realpath(config_file):
      _check_kinds(flags.FLAGS.config, given, config_file)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return None
  if missing:
    _note_missing(flags.FLAGS.config, given, missing)
  if wants_help:
    print(usage(flags.FLAGS.config, config_file, require_workdir, extra_flags), flush=True)
    raise SystemExit(0)
  if len(rest) > 1:
    print(f'error: unexpected arguments {rest[1:]}', file=sys.stderr)
    return None
  if flags.FLAGS.workdir is not None and not flags.FLAGS.workdir.strip():
    # e.g. --workdir=$DIR with DIR unset: never a fresh folder in its place
    print('error: --workdir is empty' + (
        '' if require_workdir else ' (leave it out for a fresh folder under ./runs)'),
          file=sys.stderr)
    return None
  flag = next((argv[i + 1] for i, a in enumerate(argv[1:-1], 1)
               if a in ('--workdir', '-workdir') and argv[i + 1].startswith('-')), None)
  if flag is not None:  # `--workdir --config.KEY=V`: absl takes the flag as the folder
    print(f'error: --workdir took {flag!r} as its folder, which looks like a flag; give the '
          f'folder, --workdir DIR (or --workdir={flag} for a folder of that name)',
          file=sys.stderr)
    return None
  if require_workdir and not flags.FLAGS.workdir:
    print('error: --workdir=DIR is required', file=sys.stderr)
    return None
  config = flags.FLAGS.config
  return config, expand_user_paths(config, flags.FLAGS.workdir)


def _load_config_file(path: str):
  """``get_config()`` of the config file ``path`` (its ``OSError`` when it
  cannot be read: missing, a directory)."""
  import importlib.machinery  # noqa: PLC0415
  import importlib.util  # noqa: PLC0415
  with open(path, 'rb'):
    pass
  spec = importlib.util.spec_from_file_location(
      '_pipejax_config_file', path,
      loader=importlib.machinery.SourceFileLoader('_pipejax_config_file', path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _config_file_argument(argv: list[str]) -> tuple[str | None, list[str]]:
  """The ``--config`` file that ``argv`` names (``--config=FILE`` or
  ``--config FILE``; the last one, as absl takes it), and ``argv`` without it."""
  given, rest, i = None, argv[:1], 1
  while i < len(argv):
    arg = argv[i]
    if arg.startswith(('--config=', '-config=')):
      given = arg.split('=', 1)[1]
    elif arg in ('--config', '-config') and i + 1 < len(argv):
      given = argv[i + 1]
      i += 1
    else:
      rest.append(arg)
    i += 1
  return given, rest


def _user_config_file(given: str, config_file: str, missing_out: dict | None = None):
  """``get_config()`` of the user's ``--config`` file ``given``, held
  against the command's own (:func:`_hold_against`).

  Raises:
    ConfigError: the file cannot be loaded, or sets what the command lacks.
  """
  try:
    config = _load_config_file(given)
  except OSError as e:  # missing, a directory, unreadable
    raise ConfigError(f'cannot load the --config file: {e}') from e
  except Exception as e:  # noqa: BLE001 - whatever the file's code raises
    detail = distributed.first_line(str(e), 200)
    hint = ('; a copy of an entry point\'s get_config() needs its imports too'
            if isinstance(e, NameError) else '')
    raise ConfigError(f'cannot load the --config file {given}: {type(e).__name__}'
                      + (f': {detail}' if detail else '') + hint) from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'get_config() of the --config file {given} returned a '
                      f'{type(config).__name__}, not an ml_collections.ConfigDict')
  _hold_against(config, given, config_file, missing_out)
  return config


def _a(noun: str) -> str:
  """``noun`` with its indefinite article."""
  return f'{"an" if noun[:1] in "aeiou" else "a"} {noun}'


def _same_kind(value, default) -> bool:
  """Whether a config file's ``value`` has the type of the command's
  ``default`` (an int where a float is the default is one too, a bool never
  an int), as the command line's ``--config.KEY=VALUE`` is parsed."""
  if default is None:
    return True
  if isinstance(default, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(default, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  return type(value) is type(default)


def _check_kinds(config, given: str, config_file: str) -> None:
  """Refuses (:class:`ConfigError`, one line) a value of the configuration
  ``config``, read from the user's ``--config`` file ``given`` and the
  command line's overrides, of another type than the command's default
  (``config_file``'s): a str batch size, a placeholder left unset. Run once
  the overrides are applied (they may fill a placeholder)."""
  known = dict(config_keys.flat(_load_config_file(config_file)))
  ours = dict(config_keys.flat(config))
  wrong = [(key, ours[key]) for key in known
           if key in ours and not _same_kind(ours[key], known[key])]
  if wrong:
    key, value = wrong[0]
    more = len(wrong) - 1
    raise ConfigError(f'the --config file {given} sets {key} to {value!r:.60} '
                      f'({_a(type(value).__name__)}), where this command takes '
                      f'{_a(type(known[key]).__name__)} (default: {known[key]!r})' +
                      (f' (and {more} more such key{"s" * (more > 1)})' if more else ''))


def _hold_against(config, given: str, config_file: str,
                  missing_out: dict | None = None) -> None:
  """Holds the configuration ``config`` of the user's config file ``given``
  against the command's own (``config_file``'s), in place: a key the
  command does not read is refused in one line (a typo, which would be
  ignored; with the near key), unless it is a reference that other keys
  follow (``c.get_ref``), which is named in one line; keys the file lacks
  (written for an earlier pipejax) get the command's defaults, said in one
  line (by the caller, once the command line's overrides apply, where
  ``missing_out`` collects them with their defaults).

  Raises:
    ConfigError: a key the command does not read, or a value where the
      command has a group of keys.
  """
  default = _load_config_file(config_file)
  known = dict(config_keys.flat(default))
  ours = dict(config_keys.flat(config))

  def named(key):
    near = difflib.get_close_matches(key, list(known), n=1)
    return f'{key!r}' + (f' (did you mean {near[0]!r}?)' if near else '')

  def is_reference(key):
    *groups, name = key.split('.')
    node = config
    for group in groups:
      node = node[group]
    return isinstance(node._fields.get(name), ml_collections.FieldReference)  # noqa: SLF001

  unknown = [key for key in ours if key not in known]
  for key in unknown:
    inside = next((k for k in known if k.startswith(key + '.')), None)
    if inside is not None:  # e.g. c.train = 5
      raise ConfigError(f'the --config file {given} sets {key!r} to a value, where this '
                        f'command has a group of keys ({inside} among them)')
  typos = [key for key in unknown if not is_reference(key)]
  if typos:
    raise ConfigError(f'the --config file {given} sets {", ".join(map(named, typos))}, which '
                      f'this command does not have (--help lists the keys)')
  if unknown:
    _log(f'note: the --config file {given} sets {len(unknown)} reference'
         f'{"s" * (len(unknown) > 1)} that this command does not read itself: '
         f'{", ".join(map(repr, unknown))}')
  missing = [key for key in known if key not in ours]
  if not missing:
    return
  with config.unlocked():
    for key in missing:
      *groups, name = key.split('.')
      node, source = config, default
      for group in groups:
        source = source[group]
        if group not in node:
          node[group] = type(source)()  # a group the file lacks entirely
        node = node[group]  # a ConfigDict: a group set to a value was refused above
      node[name] = copy.deepcopy(source[name])
  missing = {key: known[key] for key in missing}
  if missing_out is None:
    _note_missing(config, given, missing)
  else:  # said once the command line's overrides apply
    missing_out.update(missing)


def _note_missing(config, given: str, missing: dict) -> None:
  """One line: the keys the --config file ``given`` lacks (``missing``:
  each with its default), each with the value in force (``config``): the
  default, or the command line's."""
  now = dict(config_keys.flat(config))
  said = [f'{key}={config_keys.shown(now[key])}' for key in missing
          if now[key] == missing[key]]
  overridden = [f'{key}={config_keys.shown(now[key])}' for key in missing
                if now[key] != missing[key]]
  _log(f'note: the --config file {given} lacks {len(missing)} key'
       f'{"s" * (len(missing) > 1)} (written for an earlier pipejax?); '
       + (f'the defaults are used: {", ".join(said)}' if said else '')
       + ('; ' if said and overridden else '')
       + (f'the command line sets {", ".join(overridden)}' if overridden else ''))


def cli(config_file: str, task: str) -> int:
  """Parses the command line (:func:`parse_command_line`), then runs; flag
  errors are one line too."""
  parsed = parse_command_line(config_file)
  if parsed is None:
    return 2
  config, workdir = parsed
  try:
    distributed.check_config(config)
  except distributed.DistributedError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if distributed.is_multi_process(config) and not os.environ.get(distributed.SUPERVISED_ENV):
    # Train in a child, so that a lost peer ends this process in one line.
    return distributed.supervise(sys.orig_argv, config.distributed,
                                 elastic._checkpoint_dir(workdir))  # noqa: SLF001
  return elastic.main(config, workdir, task)
