"""The bug catalogue of CodeFix-v0: small modules with one bug, visible and hidden tests.

Each maker draws the test values from the episode's rng, so one bug gives many tasks. The
hidden tests check the same contract more thoroughly; they are written into the sandbox
only when the answer is graded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

HIDDEN_HEADER = 'import sys\nsys.path.insert(0, "/work")\n\n'


@dataclass(frozen=True)
class CodeFixTask:
    name: str
    module: str  # path of the buggy file
    files: dict[str, str] = field(hash=False)  # the repository the agent sees
    hidden_tests: str = field(hash=False)
    fix: tuple[str, str] = ("", "")  # (old, new) of the oracle's str_replace
    variant: str = ""

    @property
    def id(self) -> str:
        return f"{self.name}:{self.variant}"


def _task(name, module, source, tests, hidden, fix, variant) -> CodeFixTask:
    files = {
        module: source,
        f"tests/test_{module[:-3]}.py": tests,
        "README.md": f"# {name}\n\nThe tests in tests/ fail. Find the bug in {module} and fix it.\n"
                     "Run the tests with `python3 -m pytest -q tests`.\n",
    }
    return CodeFixTask(name, module, files, HIDDEN_HEADER + hidden, fix, variant)


def mean_divisor(r) -> CodeFixTask:
    xs = [int(r.integers(1, 100)) for _ in range(int(r.integers(3, 6)))]
    src = ('def mean(xs):\n    """Arithmetic mean of a non-empty list of numbers."""\n'
           "    return sum(xs) / (len(xs) - 1)\n")
    tests = f"from stats import mean\n\n\ndef test_mean():\n    assert mean({xs}) == {sum(xs)} / {len(xs)}\n"
    hidden = ("from stats import mean\n\n\ndef test_mean():\n"
              f"    assert mean({xs}) == {sum(xs)} / {len(xs)}\n    assert mean([5]) == 5\n"
              "    assert mean([1, 2, 3, 4]) == 2.5\n")
    return _task("mean_divisor", "stats.py", src, tests, hidden, ("(len(xs) - 1)", "len(xs)"), str(xs))


def inclusive_range(r) -> CodeFixTask:
    lo = int(r.integers(-5, 10))
    hi = lo + int(r.integers(2, 6))
    src = ('def inclusive_range(lo, hi):\n    """The integers from lo to hi, both included."""\n'
           "    return list(range(lo, hi))\n")
    tests = (f"from ranges import inclusive_range\n\n\ndef test_range():\n"
             f"    assert inclusive_range({lo}, {hi}) == {list(range(lo, hi + 1))}\n")
    hidden = (f"from ranges import inclusive_range\n\n\ndef test_range():\n"
              f"    assert inclusive_range({lo}, {hi}) == {list(range(lo, hi + 1))}\n"
              "    assert inclusive_range(3, 3) == [3]\n    assert inclusive_range(4, 2) == []\n")
    return _task("inclusive_range", "ranges.py", src, tests, hidden, ("list(range(lo, hi))", "list(range(lo, hi + 1))"),
                 f"{lo},{hi}")


WORDS = ["Level", "Racecar", "Madam", "Noon", "Refer", "Rotor", "Civic", "Kayak"]


def palindrome_case(r) -> CodeFixTask:
    word = WORDS[int(r.integers(len(WORDS)))]
    src = ('def is_palindrome(s):\n    """True when s reads the same backwards, ignoring case and non-letters."""\n'
           "    letters = [c for c in s if c.isalpha()]\n    return letters == letters[::-1]\n")
    tests = (f"from text import is_palindrome\n\n\ndef test_palindrome():\n    assert is_palindrome({word!r})\n"
             "    assert not is_palindrome('python')\n")
    hidden = (f"from text import is_palindrome\n\n\ndef test_palindrome():\n    assert is_palindrome({word!r})\n"
              "    assert is_palindrome('A man, a plan, a canal: Panama')\n    assert not is_palindrome('python')\n"
              "    assert is_palindrome('')\n")
    return _task("palindrome_case", "text.py", src, tests, hidden,
                 ("[c for c in s if c.isalpha()]", "[c.lower() for c in s if c.isalpha()]"), word)


def clamp_bound(r) -> CodeFixTask:
    lo = int(r.integers(0, 10))
    hi = lo + int(r.integers(5, 20))
    mid = int(r.integers(lo + 1, hi))
    src = ('def clamp(x, lo, hi):\n    """x limited to the interval [lo, hi]."""\n'
           "    return max(lo, min(x, lo))\n")
    tests = (f"from bounds import clamp\n\n\ndef test_clamp():\n    assert clamp({mid}, {lo}, {hi}) == {mid}\n"
             f"    assert clamp({hi + 7}, {lo}, {hi}) == {hi}\n")
    hidden = (f"from bounds import clamp\n\n\ndef test_clamp():\n    assert clamp({mid}, {lo}, {hi}) == {mid}\n"
              f"    assert clamp({hi + 7}, {lo}, {hi}) == {hi}\n    assert clamp({lo - 3}, {lo}, {hi}) == {lo}\n"
              f"    assert clamp({hi}, {lo}, {hi}) == {hi}\n")
    return _task("clamp_bound", "bounds.py", src, tests, hidden, ("min(x, lo)", "min(x, hi)"), f"{lo},{mid},{hi}")


def fizzbuzz_order(r) -> CodeFixTask:
    k = int(r.integers(1, 7)) * 15
    old = ('    if n % 3 == 0:\n        return "Fizz"\n    if n % 5 == 0:\n        return "Buzz"\n'
           '    if n % 15 == 0:\n        return "FizzBuzz"\n')
    new = ('    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n        return "Fizz"\n'
           '    if n % 5 == 0:\n        return "Buzz"\n')
    src = 'def fizzbuzz(n):\n    """"Fizz" for multiples of 3, "Buzz" of 5, "FizzBuzz" of both, else str(n)."""\n' + old \
        + "    return str(n)\n"
    tests = (f"from fizz import fizzbuzz\n\n\ndef test_fizzbuzz():\n    assert fizzbuzz({k}) == 'FizzBuzz'\n"
             "    assert fizzbuzz(9) == 'Fizz'\n")
    hidden = (f"from fizz import fizzbuzz\n\n\ndef test_fizzbuzz():\n    assert fizzbuzz({k}) == 'FizzBuzz'\n"
              "    assert [fizzbuzz(i) for i in range(1, 16)] == ['1', '2', 'Fizz', '4', 'Buzz', 'Fizz', '7', '8', "
              "'Fizz', 'Buzz', '11', 'Fizz', '13', '14', 'FizzBuzz']\n")
    return _task("fizzbuzz_order", "fizz.py", src, tests, hidden, (old, new), str(k))


def binary_search_loop(r) -> CodeFixTask:
    xs = sorted({int(r.integers(0, 100)) for _ in range(7)})
    src = ('def find(xs, target):\n    """Index of target in the sorted list xs, or -1 when absent."""\n'
           "    lo, hi = 0, len(xs) - 1\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
           "        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n"
           "            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n")
    tests = (f"from search import find\n\n\ndef test_find_last():\n    assert find({xs}, {xs[-1]}) == {len(xs) - 1}\n")
    hidden = (f"from search import find\n\n\ndef test_find_all():\n    xs = {xs}\n"
              "    for i, x in enumerate(xs):\n        assert find(xs, x) == i\n    assert find(xs, 1000) == -1\n"
              "    assert find([], 3) == -1\n    assert find([4], 4) == 0\n")
    return _task("binary_search_loop", "search.py", src, tests, hidden, ("while lo < hi:", "while lo <= hi:"),
                 str(xs))


def word_count_split(r) -> CodeFixTask:
    word = ["apple", "river", "stone", "cloud", "maple"][int(r.integers(5))]
    n = int(r.integers(2, 5))
    text = " ".join([word.capitalize()] + [word] * (n - 1)) + "\tend"
    src = ('def word_counts(text):\n    """Count words case-insensitively; words are separated by any whitespace."""\n'
           "    counts = {}\n    for w in text.split(' '):\n        counts[w] = counts.get(w, 0) + 1\n"
           "    return counts\n")
    tests = (f"from counter import word_counts\n\n\ndef test_counts():\n"
             f"    assert word_counts({text!r}) == {{{word!r}: {n}, 'end': 1}}\n")
    hidden = (f"from counter import word_counts\n\n\ndef test_counts():\n"
              f"    assert word_counts({text!r}) == {{{word!r}: {n}, 'end': 1}}\n"
              "    assert word_counts('a  B\\nb') == {'a': 1, 'b': 2}\n    assert word_counts('') == {}\n")
    return _task("word_count_split", "counter.py", src, tests, hidden,
                 ("text.split(' ')", "text.lower().split()"), f"{word}x{n}")


def fahrenheit_offset(r) -> CodeFixTask:
    c = int(r.integers(-40, 101)) // 5 * 5
    src = ('def c_to_f(celsius):\n    """Degrees Celsius to degrees Fahrenheit."""\n'
           "    return celsius * 9 / 5 + 23\n")
    tests = (f"from temperature import c_to_f\n\n\ndef test_c_to_f():\n    assert c_to_f({c}) == {c * 9 / 5 + 32}\n")
    hidden = (f"from temperature import c_to_f\n\n\ndef test_c_to_f():\n    assert c_to_f({c}) == {c * 9 / 5 + 32}\n"
              "    assert c_to_f(0) == 32\n    assert c_to_f(100) == 212\n    assert c_to_f(-40) == -40\n")
    return _task("fahrenheit_offset", "temperature.py", src, tests, hidden, ("+ 23", "+ 32"), str(c))


BUGS: dict[str, Callable[..., CodeFixTask]] = {f.__name__: f for f in (
    mean_divisor, inclusive_range, palindrome_case, clamp_bound, fizzbuzz_order, binary_search_loop,
    word_count_split, fahrenheit_offset,
)}
