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

// The claim does not sort its rows (migration 00065: they come in claim
// order by its plan's structure); the dispatcher puts each run in sequence
// order itself. Here the claim returns every batch backwards, each
// aggregate's events last first and aggregates interleaved: every aggregate
// is still published in order, each event once.
func TestDispatcherOrdersRunsWhateverTheClaimRowOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
		CREATE OR REPLACE FUNCTION outbox_claim_runs(max_events integer, max_run integer, token uuid, lease_ms bigint, max_wakeups integer)
		RETURNS TABLE (kind text, id bigint, event_id text, aggregate_type text, aggregate_id text, aggregate_seq bigint,
		               event_type text, tenant_id text, traceparent text, attempts integer, body bytea,
		               head_wakes bigint, retrying_ms bigint)
		LANGUAGE plpgsql VOLATILE AS $run$
		BEGIN
		    PERFORM outbox_consume_wakeups(max_wakeups);
		    RETURN QUERY SELECT c.* FROM outbox_claim_heads(max_events, max_run, token, lease_ms) c
		                 ORDER BY c.aggregate_seq DESC, c.aggregate_id;
		END
		$run$`); err != nil {
		t.Fatal(err)
	}
	const aggregates, per = 20, 6
	want := map[string]int{}
	for s := 1; s <= per; s++ {
		evs := make([]envelope.Envelope, aggregates)
		for a := range evs {
			evs[a] = event(fmt.Sprintf("rev-%d", a), s)
			want[fmt.Sprintf("rev-%d", a)] = per
		}
		enqueue(t, db.Pool, evs...)
	}
	rec := &outboxtest.Recorder{}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 50, MaxRun: 4, PollInterval: 5 * time.Millisecond})
	if err := d.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if dups := checkOrder(t, rec.Acks(), want, false); dups != 0 {
		t.Fatalf("%d events published twice", dups)
	}
}
