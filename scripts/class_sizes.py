#!/usr/bin/env python3
"""Size of every class (and struct) under a folder: the lines of its declaration (nested classes
and in-class bodies included) plus the lines of every out-of-line member function definition
(`Class::name(...) { ... }`, signature to closing brace) in any .h or .cc file under it.

  scripts/class_sizes.py [--limit N] [--all] [folder ...]    (default: collectives, limit 500)

Prints the classes over a tenth of the limit, largest first (--all: every class), and exits 1
when one is over the limit. A nested class's own size is listed too (Outer::Inner), and also
counted in its outer class, whose declaration holds it; its out-of-line members count for it
and for the outer class."""
import argparse
import os
import re
import sys


def strip(text):
    """Comments, string and character literals blanked (newlines kept, so lines stay)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i))
            i = j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(')' + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j]))
            i = j
        elif c in '"\'':
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == '\\' else 1
            out.append(c + re.sub(r'[^\n]', ' ', text[i + 1:j]) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def match(text, i, op, cl):
    """Index of the bracket closing the one at i."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == op:
            depth += 1
        elif text[j] == cl:
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


CLASS = re.compile(r'(?:^|[\s;])(?:template\s*<[^{;]*>\s*)?(class|struct)\s+(?:\[\[[^\]]*\]\]\s*)?'
                   r'(?:alignas\s*\([^)]*\)\s*)?(\w+)\b[^;(){=]*$', re.S)
FUNC = re.compile(r'((?:\w+\s*::\s*)+)(~?\w+|operator\s*[^\s(]+)\s*$')


def line_of(text, i):
    return text.count('\n', 0, i) + 1


def body_start(text, i):
    """From a function's parameter list at i: the index of its body's `{`, skipping a
    constructor's initializers (`a_(x), b_{y}`); -1 for a declaration."""
    j = match(text, i, '(', ')') + 1
    while j < len(text):
        c = text[j]
        if c == ';':
            return -1
        if c == '(':
            j = match(text, j, '(', ')') + 1
            continue
        if c == '{':
            k = j - 1
            while k >= 0 and text[k] in ' \t':
                k -= 1
            if k >= 0 and (text[k].isalnum() or text[k] in '_>') and j - 1 == k:
                j = match(text, j, '{', '}') + 1  # a member's brace initializer
                continue
            return j
        j += 1
    return -1


def scan(text, path, decl, bodies, prefix='', lo=0, hi=None):
    """Declarations of classes at namespace (or class) scope and out-of-line member bodies, in
    text[lo:hi]."""
    hi = len(text) if hi is None else hi
    i, start = lo, lo
    while i < hi:
        c = text[i]
        if c in ';}':
            start = i + 1
        elif c == '(':
            stmt = text[start:i]
            m = FUNC.search(stmt)
            if m and '=' not in stmt and not prefix:
                b = body_start(text, i)
                if b < 0:
                    i = match(text, i, '(', ')')
                else:
                    e = match(text, b, '{', '}')
                    quals = [q.strip() for q in m.group(1).split('::') if q.strip()]
                    first = start + len(stmt) - len(stmt.lstrip())
                    lines = line_of(text, e) - line_of(text, first) + 1
                    bodies.append((quals, lines, f'{path}:{line_of(text, first)}'))
                    i, start = e, e + 1
            else:
                i = match(text, i, '(', ')')
        elif c == '{':
            stmt = text[start:i]
            m = CLASS.search(stmt)
            e = match(text, i, '{', '}')
            if re.search(r'\bnamespace\b|extern\s*"', stmt):
                i, start = i + 1, i + 1
                continue
            if m and '(' not in stmt.split(m.group(2))[0].split('template')[-1]:
                name = prefix + m.group(2)
                first = start + stmt.find(m.group(1), m.start())
                lines = line_of(text, e) - line_of(text, first) + 1
                # (`struct Outer::Inner {` out of line counts for Outer, whose part it is)
                decl.setdefault(name, []).append((lines, f'{path}:{line_of(text, first)}'))
                scan(text, path, decl, bodies, name + '::', i + 1, e)
            i, start = e, e + 1
        i += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('folders', nargs='*', default=['collectives'])
    ap.add_argument('--limit', type=int, default=500)
    ap.add_argument('--all', action='store_true')
    a = ap.parse_args()
    decl, bodies = {}, []
    for root in a.folders:
        for dp, _, fs in os.walk(root):
            for f in sorted(fs):
                if f.endswith(('.h', '.cc')):
                    p = os.path.join(dp, f)
                    scan(strip(open(p, errors='ignore').read()), p, decl, bodies)
    names = {n.split('::')[-1]: n for n in sorted(decl, key=len, reverse=True)}
    size = {n: sum(l for l, _ in v) for n, v in decl.items()}
    where = {n: max(v)[1] for n, v in decl.items()}  # its largest part (a nested one's too)
    for quals, lines, _ in bodies:
        # The innermost qualifier that names a known class; its outer classes count it too.
        for k in range(len(quals), 0, -1):
            cls = names.get(quals[k - 1])
            if cls:
                parts = cls.split('::')
                for d in range(1, len(parts) + 1):
                    outer = '::'.join(parts[:d])
                    if outer in size:
                        size[outer] += lines
                break
    over = [n for n in size if size[n] > a.limit]
    shown = sorted(size, key=lambda n: -size[n])
    for n in shown:
        if a.all or size[n] > a.limit // 10:
            flag = '  OVER' if n in over else ''
            print(f'{size[n]:6d}  {n:40s} {where[n]}{flag}')
    print(f'{len(size)} classes; largest {size[shown[0]] if shown else 0} lines; '
          f'{len(over)} over {a.limit}')
    return 1 if over else 0


if __name__ == '__main__':
    sys.exit(main())
