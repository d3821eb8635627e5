package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// countingDB is the inbox's database with its transactions counted, and the
// first failCommits commits turned into failures (rolled back instead).
type countingDB struct {
	*pgtest.DB
	begins, commits atomic.Int64
	failCommits     int64
}

func (c *countingDB) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := c.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	c.begins.Add(1)
	return &countingTx{Tx: tx, db: c}, nil
}

func (c *countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return c.Pool.Exec(ctx, sql, args...)
}

func (c *countingDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return c.Pool.SendBatch(ctx, b)
}

type countingTx struct {
	pgx.Tx
	db *countingDB
}

func (t *countingTx) Commit(ctx context.Context) error {
	if n := t.db.commits.Add(1); n <= t.db.failCommits {
		_ = t.Tx.Rollback(ctx)
		return errors.New("injected commit failure")
	}
	return t.Tx.Commit(ctx)
}

// The Runner applies the messages a lane has waiting in one transaction:
// a backlog of 200 events over 10 aggregates is applied once each, in
// order per aggregate, in far fewer transactions than messages. When a
// batch's commit fails nothing of it counts: its messages go to their
// retries, behind their aggregates' heads, and are applied once, in order.
func TestRunnerAppliesALanesWaitingMessagesInOneTransaction(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		failCommits int64
		maxBatch    int
	}{
		{"a backlog in batches", 0, 0},
		{"failed commits retried in order", 2, 0},
		{"batches of one", 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			topo := amqp.Holdco()
			for i := range topo.Consumers {
				topo.Consumers[i].Retry = fastRetry(5)
			}
			cfg, _ := setup(t, topo)
			db := &countingDB{DB: pgtest.New(t), failCommits: tc.failCommits}
			ctx := context.Background()
			if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid, aggregate_id text, seq bigint)`); err != nil {
				t.Fatal(err)
			}
			// The backlog, in the queues before the consumer starts.
			const aggs, per = 10, 20
			var msgs []outbox.Message
			for s := 1; s <= per; s++ {
				for a := 0; a < aggs; a++ {
					msgs = append(msgs, message(newEvent("order", fmt.Sprintf("o-%d", a), "order.created", int64(s))))
				}
			}
			pub := newPublisher(t, cfg)
			for lo := 0; lo < len(msgs); lo += 10 {
				for i, err := range pub.Publish(ctx, msgs[lo:lo+10]) {
					if err != nil {
						t.Fatalf("publish %s: %v", msgs[lo+i].EventID, err)
					}
				}
			}
			consumer := "analytics" // queue analytics.ingest, bound to '#': every event
			var mu sync.Mutex
			var settled []amqp.Settlement
			r, err := amqp.NewRunner(cfg, db, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
				_, err := tx.Exec(ctx, `INSERT INTO applied (event_id, aggregate_id, seq) VALUES ($1, $2, $3)`, e.ID, e.AggregateID, e.Sequence)
				return err
			}, amqp.ConsumerConfig{Consumer: consumer, MaxBatch: tc.maxBatch, OnSettle: func(s amqp.Settlement) {
				mu.Lock()
				settled = append(settled, s)
				mu.Unlock()
			}})
			if err != nil {
				t.Fatal(err)
			}
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = r.Run(rctx) }()
			defer func() { cancel(); <-done }()

			deadline := time.Now().Add(60 * time.Second)
			var n int
			for time.Now().Before(deadline) {
				if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n >= len(msgs) {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond) // a late duplicate would show
			type row struct {
				agg string
				seq int64
			}
			rows, err := db.Pool.Query(ctx, `SELECT aggregate_id, seq FROM applied ORDER BY n`)
			if err != nil {
				t.Fatal(err)
			}
			got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
				var x row
				return x, r.Scan(&x.agg, &x.seq)
			})
			if err != nil {
				t.Fatal(err)
			}
			last := map[string]int64{}
			total := 0
			for _, r := range got {
				if r.seq != last[r.agg]+1 {
					t.Fatalf("%s: applied %d after %d (each once, in order)", r.agg, r.seq, last[r.agg])
				}
				last[r.agg] = r.seq
				total++
			}
			if total != len(msgs) {
				t.Fatalf("applied %d of %d", total, len(msgs))
			}
			begins := db.begins.Load()
			switch {
			case tc.maxBatch == 1 && begins < int64(len(msgs)):
				t.Errorf("MaxBatch 1: %d transactions for %d messages, want one each", begins, len(msgs))
			case tc.maxBatch == 0 && begins >= int64(len(msgs)):
				// Typically ~35 for this backlog; how many depends on how
				// fast deliveries reach the lanes, so only "any batching".
				t.Errorf("%d transactions for a backlog of %d messages: the runner did not batch", begins, len(msgs))
			}
			if tc.failCommits > 0 {
				mu.Lock()
				retried := 0
				for _, s := range settled {
					if s.Action == amqp.ActionRetry && s.Err != nil && strings.Contains(s.Err.Error(), "injected commit failure") {
						retried++
					}
				}
				mu.Unlock()
				if retried == 0 {
					t.Errorf("no message was retried after the injected commit failures")
				}
			}
			t.Logf("%d messages, %d transactions, %d commits", len(msgs), begins, db.commits.Load())
		})
	}
}

var _ inbox.DB = (*countingDB)(nil)
