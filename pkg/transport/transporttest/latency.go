package transporttest

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/internal/proccpu"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

var quietLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

// LatencyRun is one commit-to-consume measurement of a whole pipeline: the
// dispatcher with its defaults publishing through Publisher, and one
// runner per consumer applying through the inbox (each with a pool of its
// own, as a separate process would have).
type LatencyRun struct {
	DB        *pgtest.DB
	Publisher outbox.Publisher
	// Consumers are the consumer names, each with its lanes (for its pool size).
	Consumers map[string]int
	// Runner returns consumer's runner over db.
	Runner func(consumer string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error)
	// Events are offered at Rate per second, one business transaction each;
	// Routes says how many consumers each one reaches.
	Events []envelope.Envelope
	Routes func(envelope.Envelope) int
	Rate   int
	// BrokerProcess names the broker's process for the CPU line.
	BrokerProcess string
}

// Measure offers the events, waits until every application is seen (60s
// at most), and reports p50/p95/p99/max latency from the producer's COMMIT
// returning to a consumer's inbox transaction having committed the event
// (every consumer's application is one sample), with where the CPU went.
func (l LatencyRun) Measure(b *testing.B) {
	var mu sync.Mutex
	committed := map[string]time.Time{}
	settledAt := map[string][]time.Time{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for name, lanes := range l.Consumers {
		pc, err := pgxpool.ParseConfig(l.DB.URL)
		if err != nil {
			b.Fatal(err)
		}
		pc.MaxConns = int32(max(lanes, 1) + 2)
		pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
		pool, err := pgxpool.NewWithConfig(context.Background(), pc)
		if err != nil {
			b.Fatal(err)
		}
		defer pool.Close()
		r, err := l.Runner(name, pool, func(context.Context, pgx.Tx, envelope.Envelope) error { return nil },
			inbox.ConsumerConfig{Consumer: name, OnSettle: func(s inbox.Settlement) {
				now := time.Now()
				if s.Action != inbox.ActionApplied {
					return
				}
				mu.Lock()
				settledAt[s.EventID] = append(settledAt[s.EventID], now)
				mu.Unlock()
			}})
		if err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = r.Run(ctx) }()
	}
	d, err := outbox.NewDispatcher(l.DB.Pool, l.Publisher, outbox.DispatcherConfig{Logger: quietLogger})
	if err != nil {
		b.Fatal(err)
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()

	want := 0
	for _, e := range l.Events {
		want += l.Routes(e)
	}
	const producers = 8
	cpu := proccpu.Take(l.BrokerProcess, "postgres")
	var pw sync.WaitGroup
	start := time.Now()
	for p := 0; p < producers; p++ {
		pw.Add(1)
		go func() {
			defer pw.Done()
			for i := p; i < len(l.Events); i += producers {
				if wait := time.Until(start.Add(time.Duration(i) * time.Second / time.Duration(l.Rate))); wait > 0 {
					time.Sleep(wait)
				}
				e := l.Events[i]
				err := pgx.BeginFunc(context.Background(), l.DB.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(context.Background(), tx, e) })
				now := time.Now()
				if err != nil {
					b.Error(err)
					return
				}
				mu.Lock()
				committed[e.ID] = now
				mu.Unlock()
			}
		}()
	}
	pw.Wait()
	offered := float64(len(l.Events)) / time.Since(start).Seconds()
	deadline := time.Now().Add(60 * time.Second)
	for {
		mu.Lock()
		n := 0
		for _, ts := range settledAt {
			n += len(ts)
		}
		mu.Unlock()
		if n >= want || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	used := cpu.Since()
	cancel()
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	var lat []time.Duration
	for id, c := range committed {
		for _, at := range settledAt[id] {
			lat = append(lat, at.Sub(c))
		}
	}
	if len(lat) != want {
		b.Fatalf("%d of %d applications observed", len(lat), want)
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) time.Duration { return lat[min(int(p*float64(len(lat))), len(lat)-1)] }
	b.ReportMetric(float64(pct(0.50).Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(pct(0.99).Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds())/1000, "max-ms")
	fmt.Printf("\ncommit-to-consume latency, %d events/s offered (%.0f achieved) for %.0fs, %d consumers, %d applications\n",
		l.Rate, offered, float64(len(l.Events))/float64(l.Rate), len(l.Consumers), len(lat))
	fmt.Printf("  p50 %s  p95 %s  p99 %s  max %s   (target p99 < 250ms)\n",
		pct(0.50).Round(time.Millisecond), pct(0.95).Round(time.Millisecond), pct(0.99).Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond))
	wall := used.Machine // busy core-time of the whole machine meanwhile
	fmt.Printf("  CPU meanwhile: machine %.0f%% busy; %s %s, PostgreSQL %s, this process %s (others' work on a shared machine is the rest)\n\n",
		100*float64(wall)/float64(time.Since(start))/float64(runtime.NumCPU()), l.BrokerProcess, used.Named[l.BrokerProcess].Round(time.Millisecond),
		used.Named["postgres"].Round(time.Millisecond), used.Self.Round(time.Millisecond))
}
