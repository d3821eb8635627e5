package sns_test

import (
	"context"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// The broker goes away mid-run (killed) and comes back: publishes fail and
// back off, nothing is lost, per-aggregate order holds. The dispatcher runs
// with the shipped retry policy (no attempt cap; retryable failures retry
// for RetryFor, 24 h); only the publish timeout is shortened, so calls to
// the killed emulator fail fast.
func TestEmulatorOutage(t *testing.T) {
	t.Parallel()
	proc := emulatortest.StartProcess(t)
	topo := topology.Default()
	env := emulatortest.NewAt(t, proc.URL, topo, 5) // messages in flight at the kill return in 5s
	p := newPipeline(t, env, topo)
	pub, err := sns.NewPublisher(env.SNS, sns.PublisherConfig{TopicARN: env.TopicARN})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d, dwg := startDispatcher(t, ctx, p.db, pub, outbox.DispatcherConfig{PublishTimeout: 2 * time.Second})
	rwg := p.startReceivers(ctx)

	done := make(chan struct{})
	go func() { produce(p, 2000, 100, 5*time.Millisecond); close(done) }()
	time.Sleep(700 * time.Millisecond)
	proc.Stop()
	t.Log("emulator stopped")
	time.Sleep(2 * time.Second)
	proc.Start()
	t.Log("emulator restarted")
	<-done
	start := time.Now()
	for !p.complete() && time.Since(start) < 2*time.Minute {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond)
	cancel()
	dwg.Wait()
	rwg.Wait()
	if d.Totals().Retried == 0 {
		t.Fatal("no publish failed during the outage: the test did not exercise it")
	}
	if st, err := outbox.Stats(context.Background(), p.db.Pool); err != nil || st.Dead != 0 {
		t.Fatalf("after the outage: %+v, %v; want nothing dead", st, err)
	}
	t.Logf("dispatcher totals %+v; drained %s after the restart", d.Totals(), time.Since(start).Round(time.Millisecond))
	p.checkAllowingRepeats()
}
