/* Preloaded ahead of libfaketime by scripts/clock-runs.sh. libfaketime 0.9.10 (Debian 12)
 * shifts the deadline of clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) by the faked
 * offset even when FAKETIME_DONT_FAKE_MONOTONIC leaves that clock real: the kernel gets a
 * negative time, and Python 3.11's time.sleep, which sleeps that way, raises EINVAL
 * (libfaketime issue 426). The monotonic clock is real here, so its sleeps go straight to
 * the kernel; every other clock's go on to libfaketime. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *request,
                    struct timespec *remain)
{
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);

    if (clock == CLOCK_MONOTONIC)
        /* clock_nanosleep returns the error rather than setting errno */
        return syscall(SYS_clock_nanosleep, clock, flags, request, remain) == 0 ? 0 : errno;
    if (next == NULL)
        next = dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock, flags, request, remain);
}
