package outbox

import (
	"context"
	"fmt"
	mathrand "math/rand"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
)

// BenchmarkDispatchSkew drains the shapes real traffic has, each beside the
// uniform rate measured in the same run, with the instant publisher:
//
//	go test -run '^$' -bench BenchmarkDispatchSkew -benchtime 1x ./pkg/outbox/
//
// It prints a table of rates and the ratios issue 14 sets targets for:
// total throughput against uniform, how fast the other aggregates finish
// beside a hot or parked aggregate against alone, 100 events per aggregate
// against 5, two dispatchers against one, and one aggregate's own rate.
// Each case runs five rounds (FIFOBOX_BENCH_ROUNDS), interleaved; the table
// shows median rates, and each ratio is the median of its per-round ratios:
// a shape and its reference run back to back in a round, so they share the
// machine's conditions of the moment (on a shared 2-core machine a ratio of
// medians swung 0.77-0.98 between runs).
func BenchmarkDispatchSkew(b *testing.B) {
	rounds := skewRounds()
	for round := 0; round < rounds; round++ {
		for _, c := range skewCases() {
			b.Run(c.name, func(b *testing.B) {
				db := pgtest.New(b)
				c.fill(b, db.Pool)
				be := &backends{}
				pools := make([]*pgxpool.Pool, c.dispatchers)
				for i := range pools { // another dispatcher is another process: its own connections
					pools[i] = be.pool(b, db)
				}
				before := be.cpu()
				res := drainWatched(b, pools, c.publishable, c.watchPrefix, c.watchN)
				recordCost("skew/"+c.name, cost{
					cpuPerEvent:   float64((be.cpu() - before).Microseconds()) / float64(c.publishable),
					bytesPerEvent: float64(outboxBytes(b, db.Pool)) / float64(c.publishable+c.parked),
				})
				benchMu.Lock()
				benchRounds["skew/"+c.name] = append(benchRounds["skew/"+c.name], float64(c.publishable)/res.total.Seconds())
				if c.watchN > 0 {
					benchRounds["skew/"+c.name+"/others"] = append(benchRounds["skew/"+c.name+"/others"], float64(c.watchN)/res.watched.Seconds())
				}
				benchMu.Unlock()
				b.ReportMetric(float64(c.publishable)/res.total.Seconds(), "events/s")
			})
		}
	}
	printSkewTable()
}

type skewCase struct {
	name        string
	fill        func(testing.TB, *pgxpool.Pool)
	dispatchers int
	publishable int    // events the drain publishes (parked ones excluded)
	parked      int    // events left parked
	watchPrefix string // aggregates whose finish time is measured apart
	watchN      int
}

func skewCases() []skewCase {
	uniform := func(prefix string, aggs, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("%s%d", prefix, i%aggs)
		}
		return out
	}
	repeat := func(agg string, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = agg
		}
		return out
	}
	interleave := func(a, b []string) []string {
		var out []string
		for i := 0; i < max(len(a), len(b)); i++ {
			if i < len(a) {
				out = append(out, a[i])
			}
			if i < len(b) {
				out = append(out, b[i])
			}
		}
		return out
	}
	zipf := func(n, aggs int) []string {
		z := mathrand.NewZipf(mathrand.New(mathrand.NewSource(11)), 1.1, 1, uint64(aggs-1))
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("z-%d", z.Uint64())
		}
		return out
	}
	events := func(aggs []string, dead string) func(testing.TB, *pgxpool.Pool) {
		return func(tb testing.TB, pool *pgxpool.Pool) { fillAggregates(tb, pool, aggs, dead) }
	}
	others20k := uniform("n-", 2000, 20000)
	others50k := uniform("n-", 2000, 50000)
	return []skewCase{
		{name: "uniform-100k-over-20000", fill: events(uniform("u-", 20000, 100000), ""), dispatchers: 1, publishable: 100000},
		{name: "others-20k-alone", fill: events(others20k, ""), dispatchers: 1, publishable: 20000, watchPrefix: "n-", watchN: 20000},
		{name: "hot-50k-first+20k", fill: events(append(repeat("hot", 50000), others20k...), ""), dispatchers: 1,
			publishable: 70000, watchPrefix: "n-", watchN: 20000},
		{name: "others-50k-alone", fill: events(others50k, ""), dispatchers: 1, publishable: 50000, watchPrefix: "n-", watchN: 50000},
		{name: "hot-half-100k", fill: events(interleave(repeat("hot", 50000), others50k), ""), dispatchers: 1,
			publishable: 100000, watchPrefix: "n-", watchN: 50000},
		{name: "several-deep-first+20k", fill: events(append(uniform("deep-", 5, 50000), others20k...), ""), dispatchers: 1,
			publishable: 70000, watchPrefix: "n-", watchN: 20000},
		{name: "parked-50k+20k", fill: events(append(repeat("parked", 50000), others20k...), "parked"), dispatchers: 1,
			publishable: 20000, parked: 50000, watchPrefix: "n-", watchN: 20000},
		{name: "zipf-1.1-100k-over-10000", fill: events(zipf(100000, 10000), ""), dispatchers: 1, publishable: 100000},
		{name: "2-per-aggregate-100k", fill: events(uniform("p-", 50000, 100000), ""), dispatchers: 1, publishable: 100000},
		{name: "100k-over-1000", fill: events(uniform("t-", 1000, 100000), ""), dispatchers: 1, publishable: 100000},
		{name: "100k-over-1000-2-dispatchers", fill: events(uniform("t-", 1000, 100000), ""), dispatchers: 2, publishable: 100000},
		{name: "uniform-100k-2-dispatchers", fill: events(uniform("u-", 20000, 100000), ""), dispatchers: 2, publishable: 100000},
		{name: "one-aggregate-50k", fill: events(repeat("deep", 50000), ""), dispatchers: 1, publishable: 50000},
	}
}

// fillAggregates inserts one pending event per entry of aggs, in that order
// (ids ascending), numbering each aggregate's events 1, 2, ...; the first
// event of the aggregate named dead is dead, parking the rest behind it.
func fillAggregates(tb testing.TB, pool *pgxpool.Pool, aggs []string, dead string) {
	tb.Helper()
	ctx := context.Background()
	seq := map[string]int64{}
	const chunk = 20000
	for lo := 0; lo < len(aggs); lo += chunk {
		part := aggs[lo:min(lo+chunk, len(aggs))]
		seqs := make([]int64, len(part))
		for i, a := range part {
			seq[a]++
			seqs[i] = seq[a]
		}
		if _, err := pool.Exec(ctx, `
			INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body)
			SELECT `+timeOrderedUUID+`, 'order.updated', 'order', a, s, now(), $3::bytea
			FROM unnest($1::text[], $2::bigint[]) WITH ORDINALITY AS u(a, s, o) ORDER BY o`, part, seqs, benchBody); err != nil {
			tb.Fatal(err)
		}
	}
	if dead != "" {
		if _, err := pool.Exec(ctx, `UPDATE outbox SET state = 'dead', attempts = 1 WHERE aggregate_id = $1 AND aggregate_seq = 1`, dead); err != nil {
			tb.Fatal(err)
		}
	}
	settleOutbox(tb, pool)
}

type watched struct{ total, watched time.Duration }

// drainWatched runs dispatchers (Run, as the Lambda does) until want events
// are published, and reports when the last one was, and when the last event
// of the aggregates named prefix* was (watchN of them).
func drainWatched(b *testing.B, pools []*pgxpool.Pool, want int, prefix string, watchN int) watched {
	b.Helper()
	var all, mine atomic.Int64
	var res watched
	done := make(chan struct{})
	start := time.Now()
	var watchedAt atomic.Int64
	pub := PublisherFunc(func(ctx context.Context, msgs []Message) []error {
		n := 0
		for _, m := range msgs {
			if prefix != "" && strings.HasPrefix(m.GroupID, prefix) {
				n++
			}
		}
		if n > 0 && mine.Add(int64(n)) == int64(watchN) {
			watchedAt.Store(int64(time.Since(start)))
		}
		if all.Add(int64(len(msgs))) == int64(want) {
			close(done)
		}
		return make([]error, len(msgs))
	})
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{}, len(pools))
	b.ResetTimer()
	for _, p := range pools {
		d, err := NewDispatcher(p, pub, DispatcherConfig{BatchSize: benchBatch(), Workers: benchWorkers()})
		if err != nil {
			b.Fatal(err)
		}
		go func() { _ = d.Run(ctx); stopped <- struct{}{} }()
	}
	select {
	case <-done:
	case <-time.After(10 * time.Minute):
		b.Fatalf("published %d of %d in 10 minutes", all.Load(), want)
	}
	res.total = time.Since(start)
	b.StopTimer()
	cancel()
	for range pools {
		<-stopped
	}
	if all.Load() != int64(want) {
		b.Fatalf("published %d events, want %d", all.Load(), want)
	}
	res.watched = time.Duration(watchedAt.Load())
	return res
}

func skewRounds() int {
	if n, _ := strconv.Atoi(os.Getenv("FIFOBOX_BENCH_ROUNDS")); n > 0 {
		return n
	}
	return 5
}

func printSkewTable() {
	benchMu.Lock()
	defer benchMu.Unlock()
	m := func(k string) float64 { return median(benchRounds["skew/"+k]) }
	// r is the median of a's per-round ratios to b.
	r := func(a, b string) float64 { return median(roundRatios("skew/"+a, "skew/"+b)) }
	uni := m("uniform-100k-over-20000")
	if uni == 0 {
		return
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "\nskew: shape (instant publisher; median of %d rounds, ratios per round)\tevents/s\tratio\ttarget\tPG CPU µs/event\tbytes/event\t\n", skewRounds())
	// row prints a shape's rate and ratio; with key, also what PostgreSQL
	// spent per event (its backends' CPU) and the outbox's size per event
	// after the drain (table, TOAST and indexes; no vacuum or prune).
	row := func(name string, rate float64, ratio, target, key string) {
		c, cpu, bytes := median2(benchCosts["skew/"+key]), "", ""
		if len(benchCosts["skew/"+key]) > 0 {
			cpu, bytes = fmt.Sprintf("%.1f", c.cpuPerEvent), fmt.Sprintf("%.0f", c.bytesPerEvent)
		}
		fmt.Fprintf(w, "%s\t%.0f\t%s\t%s\t%s\t%s\t\n", name, rate, ratio, target, cpu, bytes)
	}
	row("uniform: 100,000 events over 20,000 aggregates (5 each)", uni, "1.00", "", "uniform-100k-over-20000")
	for _, c := range []struct{ name, key, alone string }{
		{"one aggregate with 50,000 events enqueued first, + 20,000 others", "hot-50k-first+20k", "others-20k-alone"},
		{"one aggregate owning half of 100,000 events", "hot-half-100k", "others-50k-alone"},
		{"5 aggregates with 10,000 events each enqueued first, + 20,000 others", "several-deep-first+20k", "others-20k-alone"},
		{"a parked aggregate with 50,000 behind it, + 20,000 others", "parked-50k+20k", "others-20k-alone"},
	} {
		row(c.name+": all published", m(c.key), fmt.Sprintf("%.2f x uniform", r(c.key, "uniform-100k-over-20000")), ">= 0.80", c.key)
		row("    the others' events, beside it / alone", m(c.key+"/others"),
			fmt.Sprintf("%.2f x alone", r(c.key+"/others", c.alone+"/others")), ">= 0.80", "")
	}
	row("Zipf(s=1.1) over 10,000 aggregates, 100,000 events", m("zipf-1.1-100k-over-10000"),
		fmt.Sprintf("%.2f x uniform", r("zipf-1.1-100k-over-10000", "uniform-100k-over-20000")), ">= 0.80", "zipf-1.1-100k-over-10000")
	row("100,000 events over 50,000 aggregates (2 each)", m("2-per-aggregate-100k"),
		fmt.Sprintf("%.2f x 20,000 aggregates", r("2-per-aggregate-100k", "uniform-100k-over-20000")), "", "2-per-aggregate-100k")
	row("100,000 events over 1,000 aggregates (100 each)", m("100k-over-1000"),
		fmt.Sprintf("%.2f x 20,000 aggregates", r("100k-over-1000", "uniform-100k-over-20000")), ">= 0.80", "100k-over-1000")
	row("    two dispatchers", m("100k-over-1000-2-dispatchers"),
		fmt.Sprintf("%.2f x one", r("100k-over-1000-2-dispatchers", "100k-over-1000")), ">= 1.00", "100k-over-1000-2-dispatchers")
	row("uniform, two dispatchers", m("uniform-100k-2-dispatchers"),
		fmt.Sprintf("%.2f x one", r("uniform-100k-2-dispatchers", "uniform-100k-over-20000")), ">= 1.00", "uniform-100k-2-dispatchers")
	row("one aggregate alone, 50,000 events (its own rate)", m("one-aggregate-50k"), "", ">= 2000/s", "one-aggregate-50k")
	fmt.Fprintf(w, "target: PostgreSQL CPU <= 15 µs/event, <= 700 bytes/event\t\t\t\t\t\t\n")
	w.Flush()
	fmt.Println()
}
