package proccpu

import (
	"os"
	"runtime"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name, line string
		comm       string
		ticks      int64
		ok         bool
	}{
		{"plain", "123 (beam.smp) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0", "beam.smp", 300, true},
		{"name with spaces and parens", "9 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 1 2 0", "a (b) c", 3, true},
		{"truncated", "9 (x) R 1 2", "", 0, false},
		{"no name", "garbage", "", 0, false},
		{"not numbers", "9 (x) R 1 2 3 4 5 6 7 8 9 10 u s", "", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			comm, ticks, ok := parse([]byte(tc.line))
			if comm != tc.comm || ticks != tc.ticks || ok != tc.ok {
				t.Fatalf("parse(%q) = %q, %d, %v; want %q, %d, %v", tc.line, comm, ticks, ok, tc.comm, tc.ticks, tc.ok)
			}
		})
	}
}

func TestReadingsGrowWithWork(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	s := Take("no-such-process-name")
	end := time.Now().Add(300 * time.Millisecond)
	x := 0
	for time.Now().Before(end) {
		x++
	}
	d := s.Since()
	if d.Self < 100*time.Millisecond {
		t.Fatalf("this process used %v of CPU spinning 300 ms (x=%d)", d.Self, x)
	}
	if d.Machine < d.Self {
		t.Fatalf("machine busy %v < this process %v", d.Machine, d.Self)
	}
	if d.Named["no-such-process-name"] != 0 {
		t.Fatalf("an absent process used %v", d.Named["no-such-process-name"])
	}
}
