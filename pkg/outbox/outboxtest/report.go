package outboxtest

import (
	"fmt"
	"io"

	"github.com/fifobox/fifobox/internal/proccpu"
)

// CostRow is one line of a transport benchmark's table: a side and what it
// measured.
type CostRow struct {
	Name string
	Cost proccpu.Cost
}

// Report prints a transport benchmark's rates, where each side's CPU went
// (the broker's process, the benchmark's own process, the rest of the
// machine: PostgreSQL), and the ratios the targets judge.
//
// raw, disp and instant are the raw client's rate, the dispatcher's through
// the broker and the dispatcher's with an instant publisher. On a machine
// where the broker, PostgreSQL and the dispatcher share the cores, the
// dispatcher can at best spend the CPU of both: its ceiling is
// 1 / (1/raw + 1/instant), and "dispatcher / that ceiling" says how much of
// it the pipeline reaches. On separate machines (Amazon MQ or a NATS
// cluster, Aurora, Lambda) the ceiling is min(raw, instant).
func Report(w io.Writer, broker, process string, rows []CostRow, raw, disp, instant float64) {
	fmt.Fprintf(w, "%-52s %10s %8s   %s\n", "", "events/s", "busy", "CPU per event: "+broker+" / this process / rest (PostgreSQL)")
	for _, r := range rows {
		b, s, o := r.Cost.PerEvent(process)
		fmt.Fprintf(w, "%-52s %10.0f %7.0f%%   %5.1f / %5.1f / %5.1f µs\n", r.Name, r.Cost.Rate, 100*r.Cost.Busy(), b, s, o)
	}
	if raw <= 0 || disp <= 0 || instant <= 0 {
		return
	}
	ceiling := 1 / (1/raw + 1/instant)
	fmt.Fprintf(w, "%-52s %10.0f\n", "shared-core ceiling 1/(1/raw + 1/instant)", ceiling)
	fmt.Fprintf(w, "%-52s %9.0f%%\n", "dispatcher / shared-core ceiling", 100*disp/ceiling)
	fmt.Fprintf(w, "%-52s %9.0f%%   (at most %.0f%% on shared cores)\n", "instant / raw: the outbox alone against the broker", 100*instant/raw, 100*ceiling/raw)
	fmt.Fprintf(w, "%-52s %9.0f%%   (target >= 80%%)\n\n", "dispatcher / raw", 100*disp/raw)
}
