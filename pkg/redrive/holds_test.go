package redrive_test

import (
	"context"
	"testing"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

type countingDLQ struct{ sent int }

func (d *countingDLQ) SendMessage(context.Context, *sqs.SendMessageInput, ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	d.sent++
	return &sqs.SendMessageOutput{MessageId: aws.String("m")}, nil
}

// A hold whose dead-lettered message is gone (purged, expired) would hold
// its group for good: release-holds ends it, audited, for one group or all
// of a consumer's, and the group's next event is applied again.
func TestReleaseHolds(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	for _, r := range [][2]string{{"c", "g1"}, {"c", "g1"}, {"c", "g2"}, {"d", "g1"}} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_held (consumer, group_id, message_key, class) VALUES ($1, $2, $3, 'permanent')`,
			r[0], r[1], uuid.NewString()); err != nil {
			t.Fatal(err)
		}
	}
	dlq := &countingDLQ{}
	var applied int
	h, err := sns.NewHandler(db.Pool, dlq, func(context.Context, pgx.Tx, envelope.Envelope) error { applied++; return nil },
		sns.HandlerConfig{Consumer: "c", DLQURL: "d", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	deliver := func(group string) {
		e := event("order", group, "order.paid")
		e.Sequence = 5
		b, _ := e.Encode()
		if resp, err := h.Handle(ctx, events.SQSEvent{Records: []events.SQSMessage{{MessageId: uuid.NewString(), Body: string(b),
			Attributes: map[string]string{"MessageGroupId": group}}}}); err != nil || len(resp.BatchItemFailures) != 0 {
			t.Fatalf("handle: %+v %v", resp, err)
		}
	}
	deliver("g1")
	if applied != 0 || dlq.sent != 1 {
		t.Fatalf("g1 is held: applied %d, dead-lettered %d", applied, dlq.sent)
	}
	svc, _ := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	if _, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReleaseHolds}); err == nil {
		t.Fatal("release-holds without a consumer accepted")
	}
	dry, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReleaseHolds, Consumer: "c", DryRun: true})
	if err != nil || dry.Affected != 4 || dry.Aggregates != 2 { // g1 has its two rows and the held g1/5
		t.Fatalf("dry run %+v %v", dry, err)
	}
	res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReleaseHolds, Consumer: "c", Groups: []string{"g1"}, Actor: "test"})
	if err != nil || res.Affected != 3 || res.AuditID == 0 {
		t.Fatalf("release g1: %+v %v", res, err)
	}
	deliver("g1")
	if applied != 1 {
		t.Fatalf("g1 after its release: applied %d, want 1", applied)
	}
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_held`).Scan(&left); err != nil || left != 2 {
		t.Fatalf("%d held rows left (%v), want c/g2 and d/g1", left, err)
	}
	audit, _ := redrive.ListAudit(ctx, db.Pool, 5)
	if len(audit) != 2 || audit[0].Operation != redrive.OpReleaseHolds || audit[0].Affected != 3 || !audit[1].DryRun {
		t.Fatalf("audit %+v", audit)
	}
}
