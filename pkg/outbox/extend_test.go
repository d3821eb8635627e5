package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// A claim gives an aggregate at most MaxRun events while other aggregates
// compete for the batch; with room left, a run that reached MaxRun is
// extended, never past an event that is not pending (here a dead one) and
// never for a claim that no longer holds the head.
func TestRunsExtendOnlyWhenTheBatchHasRoom(t *testing.T) {
	t.Parallel()
	cfg := outbox.DispatcherConfig{BatchSize: 500, MaxRun: 50, RunBudget: time.Hour, Workers: 1}
	for _, tc := range []struct {
		name      string
		others    int   // aggregates with 10 events each, enqueued after "deep"
		deadSeq   int64 // deep's event made dead before the claim (0: none)
		wantDeep  int   // deep's events in the first batch
		wantTotal int
	}{
		{name: "alone", wantDeep: 500, wantTotal: 500},
		{name: "competing", others: 100, wantDeep: 50, wantTotal: 500},
		{name: "some room", others: 20, wantDeep: 300, wantTotal: 500},
		{name: "stops before a dead event", deadSeq: 120, wantDeep: 119, wantTotal: 119},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := context.Background()
			var evs []envelope.Envelope
			for i := 1; i <= 2000; i++ {
				evs = append(evs, event("deep", i))
			}
			enqueue(t, db.Pool, evs...)
			evs = nil
			for a := 0; a < tc.others; a++ {
				for i := 1; i <= 10; i++ {
					evs = append(evs, event(fmt.Sprintf("other-%d", a), i))
				}
			}
			if len(evs) > 0 {
				enqueue(t, db.Pool, evs...)
			}
			if tc.deadSeq > 0 {
				if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET state = 'dead' WHERE aggregate_id = 'deep' AND aggregate_seq = $1`, tc.deadSeq); err != nil {
					t.Fatal(err)
				}
			}
			rec := &outboxtest.Recorder{}
			d := newDispatcher(t, db.Pool, rec, cfg)
			res, err := d.RunOnce(ctx)
			if err != nil {
				t.Fatal(err)
			}
			deep := 0
			for _, a := range rec.Acks() {
				if a.AggregateID == "deep" {
					deep++
					if a.Sequence != int64(deep) {
						t.Fatalf("deep's %dth event published has sequence %d", deep, a.Sequence)
					}
				}
			}
			if deep != tc.wantDeep || res.Claimed != tc.wantTotal || res.Sent != tc.wantTotal {
				t.Fatalf("first batch: deep %d, claimed %d, sent %d; want deep %d, %d claimed and sent",
					deep, res.Claimed, res.Sent, tc.wantDeep, tc.wantTotal)
			}
		})
	}
	t.Run("not for a claim that lost its head", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		ctx := context.Background()
		var evs []envelope.Envelope
		for i := 1; i <= 20; i++ {
			evs = append(evs, event("deep", i))
		}
		enqueue(t, db.Pool, evs...)
		const token = "00000000-0000-4000-8000-000000000001"
		var claimed int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_claim_runs(500, 5, $1, 60000, 100) WHERE kind = 'event'`, token).Scan(&claimed); err != nil {
			t.Fatal(err)
		}
		for _, tok := range []struct {
			token string
			want  int
		}{{token, 15}, {"00000000-0000-4000-8000-000000000002", 0}} {
			var n int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_extend_run('order', 'deep', 5, 100, $1)`, tok.token).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if claimed != 5 || n != tok.want {
				t.Fatalf("claimed %d, extension with token %s returned %d; want 5 and %d", claimed, tok.token, n, tok.want)
			}
		}
	})
}
