package nats_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// TestPartitionKeepsOrder: the runner's connection is partitioned (no FIN,
// no RST: the server keeps it, and its pull requests, open) while events of
// three aggregates arrive. The client notices by its pings and reconnects
// by another path; whatever the server sends to the dead connection
// meanwhile, redeliveries included, is lost. Every aggregate's events must
// still be applied in order, each once: when the partition comes with
// events in flight, and when it comes before the session's first delivery
// (nothing received yet to see a gap after).
func TestPartitionKeepsOrder(t *testing.T) {
	for _, tt := range []struct {
		name   string
		before int // rounds applied before the partition
	}{
		{"events in flight", 3},
		{"before the first delivery", 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			testPartition(t, tt.before)
		})
	}
}

func testPartition(t *testing.T, before int) {
	const rounds = 20
	aggs := []string{"a", "b", "c"}
	cfg := setup(t, nats.Topology{Stream: "PART", SubjectPrefix: "part", Consumers: []nats.Consumer{{
		Name: "c", Filters: []string{">"}, AckWait: transport.Duration(2 * time.Second),
		Retry: fastRetry(3)}}})
	pub := newPublisher(t, cfg)

	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial PRIMARY KEY, agg text, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	// The first time each event is applied (a rolled-back apply counts: it
	// shows the runner had it), for the liveness figure.
	var mu sync.Mutex
	firstApplied := map[string]time.Time{}
	apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		mu.Lock()
		k := fmt.Sprintf("%s/%d", e.AggregateID, e.Sequence)
		if _, ok := firstApplied[k]; !ok {
			firstApplied[k] = time.Now()
		}
		mu.Unlock()
		time.Sleep(5 * time.Millisecond) // a side effect: keeps deliveries in hand
		_, err := tx.Exec(ctx, `INSERT INTO applied (agg, seq) VALUES ($1, $2)`, e.AggregateID, e.Sequence)
		return err
	}
	px := transporttest.NewProxy(t, strings.TrimPrefix(serverURL(), "nats://"))
	rcfg := cfg
	rcfg.URL = "nats://" + px.Addr()
	rcfg.PingInterval = 200 * time.Millisecond // the partition is noticed in 0.4-0.6 s
	if testing.Verbose() {
		rcfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	r, err := nats.NewRunner(rcfg, db.Pool, apply, inbox.ConsumerConfig{Consumer: "c"})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })

	// The publisher (not through the proxy) goes on through the partition:
	// one event of each aggregate every 400ms.
	var published atomic.Int64 // rounds published
	pubDone := make(chan error, 1)
	start := make(chan struct{})
	if before > 0 {
		close(start)
	}
	go func() {
		<-start
		for i := 1; i <= rounds; i++ {
			msgs := make([]outbox.Message, len(aggs))
			for j, a := range aggs {
				msgs[j] = message(newEvent("order", a, "changed", int64(i)))
			}
			for k, err := range pub.Publish(ctx, msgs) {
				if err != nil {
					pubDone <- fmt.Errorf("publish round %d event %d: %w", i, k, err)
					return
				}
			}
			published.Store(int64(i))
			time.Sleep(400 * time.Millisecond)
		}
		pubDone <- nil
	}()

	count := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if before > 0 {
		eventually(t, 15*time.Second, "the runner applying", func() bool { return count() >= before*len(aggs) })
	} else {
		// The runner is pulling: its pull request waits on the server.
		cons, err := dialRaw(t).js.Consumer(ctx, cfg.Topology.Stream, "c")
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, 15*time.Second, "the runner's pull request", func() bool {
			info, err := cons.Info(ctx)
			return err == nil && info.NumWaiting > 0
		})
	}
	if n := px.Partition(); n == 0 {
		t.Fatal("the runner has no connection through the proxy to partition")
	}
	partitioned := time.Now()
	if before == 0 {
		close(start)
	}
	after := published.Load() + 1 // the first round published after the partition
	if err := <-pubDone; err != nil {
		t.Fatal(err)
	}
	eventually(t, 3*time.Minute, "every event applied", func() bool { return count() >= rounds*len(aggs) })
	time.Sleep(500 * time.Millisecond) // a late duplicate would show now

	mu.Lock()
	resumed := time.Duration(1<<63 - 1)
	for k, at := range firstApplied {
		var a string
		var seq int64
		if _, err := fmt.Sscanf(strings.Replace(k, "/", " ", 1), "%s %d", &a, &seq); err == nil && seq >= after {
			resumed = min(resumed, at.Sub(partitioned))
		}
	}
	mu.Unlock()
	t.Logf("partition at round %d; the runner applied an event published after it %s later", after-1, resumed.Round(10*time.Millisecond))

	rows, err := db.Pool.Query(ctx, `SELECT agg, seq FROM applied ORDER BY n`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]int64{}
	for rows.Next() {
		var a string
		var s int64
		if err := rows.Scan(&a, &s); err != nil {
			t.Fatal(err)
		}
		got[a] = append(got[a], s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, a := range aggs {
		s := got[a]
		ok := len(s) == rounds
		for i := 0; ok && i < len(s); i++ {
			ok = s[i] == int64(i+1)
		}
		if !ok {
			t.Errorf("aggregate %s applied %v, want 1..%d in order, each once", a, s, rounds)
		}
	}
	if n := px.Heal(); n == 0 {
		t.Error("the partitioned connection was gone before Heal: the server never kept a dead connection open")
	}
}
