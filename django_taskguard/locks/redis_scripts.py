"""The Redis lock's Lua scripts, each with its contract, and how their calls are packed.

Every script is called by ``EVALSHA`` and sent again with ``EVAL`` after
``NOSCRIPT`` (a restart or a failover empties the script cache).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Script:
    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> Script:
        return cls(source, hashlib.sha1(source.encode()).hexdigest())


# What a finished slot's lock key holds for FINISHED_MARKER_SECONDS: never a token
# (tokens are 32 hex characters), so no compare-and-set on a token ever matches it. It
# stands for a row in ``states.TERMINAL_STATES`` (the guard leaves it on exactly those),
# and ACQUIRE counts every call that meets it, as the database counts every call on a row
# in ``states.DUPLICATE_STATES``: tests/test_states.py walks every state through both.
FINISHED_MARKER = "=done"

# Take the lock for ARGV[1] for ARGV[2] ms (or find it already ours): 1. Else count
# one duplicate on the claim record (ARGV[4] = task, ARGV[6] = a keyed run's key or
# ''; it lives ARGV[3] ms): 2 when the key holds the finished marker (always
# counted), 0 for a live holder (counted unless ARGV[5] is '0'). SET NX GET
# (Redis >= 7) answers "was it free, and whose is it" in one command.
ACQUIRE = Script.of(
    "local held = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'GET', 'PX', ARGV[2]) "
    "if not held then redis.call('HSET', KEYS[2], 'task', ARGV[4], 'token', ARGV[1]) "
    "if ARGV[6] ~= '' then redis.call('HSET', KEYS[2], 'key', ARGV[6]) end "
    "redis.call('PEXPIRE', KEYS[2], ARGV[3]) return 1 end "
    "if held == ARGV[1] then return 1 end "
    f"local finished = held == '{FINISHED_MARKER}' "
    "if not finished and ARGV[5] == '0' then return 0 end "
    "redis.call('HINCRBY', KEYS[2], 'count', 1) redis.call('HSETNX', KEYS[2], 'task', ARGV[4]) "
    "if ARGV[6] ~= '' then redis.call('HSETNX', KEYS[2], 'key', ARGV[6]) end "
    "redis.call('PEXPIRE', KEYS[2], ARGV[3]) "
    "if finished then return 2 end return 0"
)
# Extend the lease to ARGV[2] ms only while the lock holds token ARGV[1]. 1 = extended.
EXTEND = Script.of(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
# Delete the lock only while it holds token ARGV[1] (never a plain DEL), and
# the claim record too when it is ours and counted nobody. 1 = released.
RELEASE = Script.of(
    "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end "
    "redis.call('DEL', KEYS[1]) "
    "if redis.call('HGET', KEYS[2], 'token') == ARGV[1] "
    "and not redis.call('HGET', KEYS[2], 'count') then redis.call('DEL', KEYS[2]) end "
    "return 1"
)
# Delete the lock only while it holds token ARGV[1]; return the duplicates counted
# on the claim record and delete it, only when the record is this token's claim.
RELEASE_COUNTED = Script.of(
    "local n = 0 "
    "if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then "
    "n = tonumber(redis.call('HGET', KEYS[2], 'count')) or 0 redis.call('DEL', KEYS[2]) end "
    "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end "
    "return n"
)
# The winner's row is recorded finished: if the lock holds token ARGV[1] or is gone,
# leave the finished marker there for ARGV[2] ms (ARGV[2] = '0': delete the lock).
# Return the duplicates counted on the claim record and delete it, only when the
# record is this token's claim.
FINISH = Script.of(
    "local held = redis.call('GET', KEYS[1]) "
    "if held == ARGV[1] or not held then "
    "if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) "
    f"else redis.call('SET', KEYS[1], '{FINISHED_MARKER}', 'PX', ARGV[2]) end end "
    "local n = 0 "
    "if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then "
    "n = tonumber(redis.call('HGET', KEYS[2], 'count')) or 0 redis.call('DEL', KEYS[2]) end "
    "return n"
)
# Return the duplicates counted on the claim record and delete the record.
TAKE_DUPLICATES = Script.of(
    "local n = redis.call('HGET', KEYS[1], 'count') redis.call('DEL', KEYS[1]) "
    "return tonumber(n) or 0"
)
# Forget ARGV[1] recorded duplicates of a claim record whose lock is gone (or holds
# the finished marker); counts added since stay. 1 = done, 0 = the lock is held
# again (leave it).
FORGET_CLAIM = Script.of(
    "local held = redis.call('GET', KEYS[1]) "
    f"if held and held ~= '{FINISHED_MARKER}' then return 0 end "
    "local left = (tonumber(redis.call('HGET', KEYS[2], 'count')) or 0) - tonumber(ARGV[1]) "
    "if left > 0 then redis.call('HSET', KEYS[2], 'count', left) "
    "redis.call('HDEL', KEYS[2], 'token') else redis.call('DEL', KEYS[2]) end "
    "return 1"
)
# Set KEYS[1] to ARGV[1] for ARGV[2] seconds unless it exists. 1 = set (ours now).
CLAIM_ONCE = Script.of(
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 1 end return 0"
)
# Set KEYS[1] to ARGV[1] for ARGV[2] ms unless it exists; nil: set (ours now), else what
# it holds (which may equal ARGV[1]: a caller that chose the value of the holder). One
# round trip answers "taken, and by whom".
CLAIM_OR_READ = Script.of("return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'GET', 'PX', ARGV[2])")
# Delete KEYS[1] only while it holds ARGV[1] (never a plain DEL). 1 = deleted.
COMPARE_DELETE = Script.of(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def pack(*parts: str | int) -> bytes:
    """One command in the Redis protocol (RESP), ready for ``send_packed_command``."""
    chunks = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = str(part).encode()
        chunks.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(chunks)
