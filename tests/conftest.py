"""Every test sees 8 fake CPU devices: set before JAX is imported anywhere."""
import os

# Compiling is most of a test's time on a cold cache (its models are tiny):
# XLA:CPU compiles at LLVM's -O0, which takes 40% off the compile time. The programs
# are the same; only their machine code is slower. (Turning XLA:CPU's fusion
# emitters off as well would compile faster still, but then the two pipeline
# exchanges round differently, and the tests that hold them bit for bit fail.)
# Children started by tests inherit these flags (``fixtures.xla_flags``).
COMPILE_FAST = '--xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = ' '.join([COMPILE_FAST, os.environ.get('XLA_FLAGS', ''),
                                    '--xla_force_host_platform_device_count=8'])
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
# Runs started by tests keep their traced programs and initialisations apart
# from the user's.
os.environ.setdefault('PIPEJAX_PROGRAM_STORE', os.path.join(
    os.path.expanduser('~'), '.cache', 'pipejax', 'programs-tests'))
os.environ.setdefault('PIPEJAX_INIT_CACHE', os.path.join(
    os.path.expanduser('~'), '.cache', 'pipejax', 'init-tests'))

import warnings  # noqa: E402

warnings.filterwarnings('ignore', message='.*TensorFlow and JAX classes are deprecated.*')

import jax  # noqa: E402

jax.config.update('jax_compilation_cache_dir',
                  os.path.join(os.path.expanduser('~'), '.cache', 'pipejax', 'jax-tests'))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
