// Package proccpu reads how much CPU time processes on this machine have
// used, from /proc. The transport benchmarks use it to show where a shared
// machine's cores went (the broker, PostgreSQL, the benchmark itself):
// there the dispatcher and the raw client compete with the broker and the
// database for the same cores, and a ratio of rates means little without it.
// Read-only; on a machine without /proc every reading is zero.
package proccpu

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"
)

// clockTick is USER_HZ, the unit of utime and stime in /proc/<pid>/stat:
// 100 on every Linux architecture Go supports.
const clockTick = 10 * time.Millisecond

// Of returns the CPU time (user plus system) used so far by the live
// processes whose command name is name (as in /proc/<pid>/comm, e.g.
// "beam.smp", "nats-server", "postgres"). Processes that have exited are
// not counted: take readings of long-lived processes only.
func Of(name string) time.Duration {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var total time.Duration
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // exited since the glob
		}
		comm, ticks, ok := parse(b)
		if ok && comm == name {
			total += time.Duration(ticks) * clockTick
		}
	}
	return total
}

// Machine returns the CPU time all cores have spent busy (user, nice,
// system, irq, softirq) since boot, from /proc/stat.
func Machine() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := bytes.Fields(line)
	if len(f) < 8 || string(f[0]) != "cpu" {
		return 0
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 6, 7} {
		n, _ := strconv.ParseInt(string(f[i]), 10, 64)
		ticks += n
	}
	return time.Duration(ticks) * clockTick
}

// Self returns the CPU time this process has used.
func Self() time.Duration {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0
	}
	_, ticks, _ := parse(b)
	return time.Duration(ticks) * clockTick
}

// Family returns the CPU time used so far by process pid and its live
// children: a PostgreSQL postmaster and its backends (a private cluster's,
// so that other work on the machine is not counted). Children that have
// exited are not counted; a pool's backends live as long as the pool.
func Family(pid int) time.Duration {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var total time.Duration
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		self, parent, ticks, ok := parseIDs(b)
		if ok && (self == pid || parent == pid) {
			total += time.Duration(ticks) * clockTick
		}
	}
	return total
}

// Parent returns pid's parent process id (0 if unknown).
func Parent(pid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	_, parent, _, _ := parseIDs(b)
	return parent
}

// parseIDs reads pid, ppid and utime+stime from a /proc/<pid>/stat line.
func parseIDs(b []byte) (pid, ppid int, ticks int64, ok bool) {
	hi := bytes.LastIndexByte(b, ')')
	sp := bytes.IndexByte(b, ' ')
	if hi < 0 || sp < 0 || sp > hi {
		return 0, 0, 0, false
	}
	_, ticks, ok = parse(b)
	f := bytes.Fields(b[hi+1:])
	if !ok || len(f) < 2 {
		return 0, 0, 0, false
	}
	pid, err1 := strconv.Atoi(string(b[:sp]))
	ppid, err2 := strconv.Atoi(string(f[1]))
	return pid, ppid, ticks, err1 == nil && err2 == nil
}

// parse reads the command name and utime+stime from a /proc/<pid>/stat
// line. The name is in parentheses and may itself hold spaces or
// parentheses, so fields are counted from the last ')'.
func parse(b []byte) (string, int64, bool) {
	lo, hi := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if lo < 0 || hi < lo {
		return "", 0, false
	}
	f := bytes.Fields(b[hi+1:])
	// After the name: state(0) ppid(1) ... utime(11) stime(12).
	if len(f) < 13 {
		return "", 0, false
	}
	u, err1 := strconv.ParseInt(string(f[11]), 10, 64)
	s, err2 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return "", 0, false
	}
	return string(b[lo+1 : hi]), u + s, true
}

// Sample is a reading of the machine, this process and named processes.
type Sample struct {
	Machine, Self time.Duration
	Named         map[string]time.Duration
}

// Take reads the machine, this process and each named process.
func Take(names ...string) Sample {
	s := Sample{Machine: Machine(), Self: Self(), Named: map[string]time.Duration{}}
	for _, n := range names {
		s.Named[n] = Of(n)
	}
	return s
}

// Since returns what was used between s and now, for the same names.
func (s Sample) Since() Sample {
	names := make([]string, 0, len(s.Named))
	for n := range s.Named {
		names = append(names, n)
	}
	now := Take(names...)
	d := Sample{Machine: now.Machine - s.Machine, Self: now.Self - s.Self, Named: map[string]time.Duration{}}
	for n, v := range now.Named {
		d.Named[n] = v - s.Named[n]
	}
	return d
}

// Cost is one measured run: its rate and what it used.
type Cost struct {
	Rate float64 // events per second
	N    int     // events
	Wall time.Duration
	Used Sample
}

// Measure runs f (which handles n events and returns its rate) and records
// the CPU the machine, this process and the named processes used meanwhile.
func Measure(n int, f func() float64, names ...string) Cost {
	s := Take(names...)
	start := time.Now()
	r := f()
	return Cost{Rate: r, N: n, Wall: time.Since(start), Used: s.Since()}
}

// PerEvent returns microseconds of CPU per event used by the named process,
// by this process, and by everything else on the machine (on a benchmark
// machine: PostgreSQL's backends).
func (c Cost) PerEvent(name string) (named, self, rest float64) {
	if c.N == 0 {
		return 0, 0, 0
	}
	us := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(c.N) }
	other := c.Used.Machine - c.Used.Self - c.Used.Named[name]
	return us(c.Used.Named[name]), us(c.Used.Self), us(max(other, 0))
}

// Busy returns the fraction of the machine's cores that were busy.
func (c Cost) Busy() float64 {
	if c.Wall <= 0 {
		return 0
	}
	return c.Used.Machine.Seconds() / (c.Wall.Seconds() * float64(runtime.NumCPU()))
}

// Pids returns the CPU time used so far by the live processes pids: a
// connection pool's PostgreSQL backends (pg_backend_pid of each
// connection), so that other clients of a shared server are not counted.
func Pids(pids ...int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			continue // exited
		}
		if _, ticks, ok := parse(b); ok {
			total += time.Duration(ticks) * clockTick
		}
	}
	return total
}
