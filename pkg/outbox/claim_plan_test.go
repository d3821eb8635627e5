package outbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// Halfway through a drain, with the first half sent, a claim must read about
// one outbox row per event it claims: the partial indexes keep sent rows out
// of its way. A claim that rescans sent rows would read ~backlog/batch.
func TestClaimReadsAboutOneRowPerEvent(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	const aggregates, rounds = 500, 20 // 10,000 events, interleaved
	for r := 0; r < rounds; r++ {
		evs := make([]envelope.Envelope, aggregates)
		for a := range evs {
			evs[a] = event(fmt.Sprintf("plan-%d", a), r)
		}
		enqueue(t, db.Pool, evs...)
	}
	if _, err := db.Pool.Exec(ctx, "ANALYZE outbox"); err != nil {
		t.Fatal(err)
	}
	d := newDispatcher(t, db.Pool, &outboxtest.Recorder{}, outbox.DispatcherConfig{BatchSize: 250, Workers: 1})
	for d.Totals().Sent < aggregates*rounds/2 {
		if _, err := d.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	perEvent, err := outbox.ClaimRowsReadPerEvent(ctx, db.Pool, 250)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("claim reads %.2f outbox rows per claimed event at 50%% drained", perEvent)
	if perEvent > 1.5 {
		t.Fatalf("claim reads %.2f rows per event; want about 1 (sent rows are being rescanned)", perEvent)
	}
}
