"""Text helpers: slugs, case conversion, word wrapping, run-length coding, ciphers."""

VOWELS = "aeiou"


def slugify(text, separator="-"):
    """Lower-case words of letters and digits joined by `separator`."""
    words = []
    current = []
    for char in text.lower():
        if char.isalnum():
            current.append(char)
        elif current:
            words.append("".join(current))
            current = []
    if current:
        words.append("".join(current))
    return separator.join(words)


def camel_to_snake(name):
    """'parseHttpResponse' -> 'parse_http_response'."""
    out = []
    for i, char in enumerate(name):
        if char.isupper():
            if i > 0 and not name[i - 1].isupper():
                out.append("_")
            out.append(char.lower())
        else:
            out.append(char)
    return "".join(out)


def snake_to_camel(name, upper_first=False):
    """'parse_http_response' -> 'parseHttpResponse' (or 'ParseHttpResponse')."""
    parts = [p for p in name.split("_") if p]
    if not parts:
        return ""
    head = parts[0].capitalize() if upper_first else parts[0].lower()
    return head + "".join(p.capitalize() for p in parts[1:])


def wrap(text, width):
    """Greedy word wrap: lines of at most `width` characters (longer words stand alone)."""
    if width < 1:
        raise ValueError("width must be positive")
    lines = []
    line = ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def rle_encode(text):
    """Run-length encoding: 'aaab' -> [('a', 3), ('b', 1)]."""
    runs = []
    for char in text:
        if runs and runs[-1][0] == char:
            runs[-1] = (char, runs[-1][1] + 1)
        else:
            runs.append((char, 1))
    return runs


def rle_decode(runs):
    """Inverse of rle_encode."""
    return "".join(char * count for char, count in runs)


def caesar(text, shift):
    """Shift letters by `shift` places, keeping case; other characters are unchanged."""
    out = []
    for char in text:
        if "a" <= char <= "z":
            out.append(chr((ord(char) - ord("a") + shift) % 26 + ord("a")))
        elif "A" <= char <= "Z":
            out.append(chr((ord(char) - ord("A") + shift) % 26 + ord("A")))
        else:
            out.append(char)
    return "".join(out)


def is_palindrome(text):
    """True when the letters and digits read the same both ways (case ignored)."""
    kept = [c.lower() for c in text if c.isalnum()]
    return kept == kept[::-1]


def count_vowels(text):
    return sum(1 for c in text.lower() if c in VOWELS)


def truncate(text, limit, ellipsis="..."):
    """Cut `text` to at most `limit` characters, ending with `ellipsis` when cut."""
    if len(text) <= limit:
        return text
    if limit <= len(ellipsis):
        return ellipsis[:limit]
    return text[:limit - len(ellipsis)] + ellipsis
