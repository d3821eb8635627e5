package sns_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/sns"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

func TestMain(m *testing.M) { transporttest.Main(m, harness) }

// TestConformance runs the suite every transport passes against the SNS/SQS
// emulator, each test on a topic and queues of its own.
func TestConformance(t *testing.T) { transporttest.Run(t, harness) }

// spec is a deployment as a child process rebuilds it.
type spec struct {
	Endpoint   string            `json:"endpoint"`
	TopicARN   string            `json:"topic_arn"`
	Queues     sns.Queues        `json:"queues"`
	Topology   topology.Topology `json:"topology"`
	MaxRetries int               `json:"max_retries"`
	RetryDelay time.Duration     `json:"retry_delay"`
}

var harness = transporttest.Harness{
	Name: "sns",
	New: func(t *testing.T, o transporttest.Options) transporttest.Deployment {
		ep := emulatortest.Endpoint(t)
		// The queues' visibility timeout is how long a killed consumer's
		// records stay in flight: the kill tests wait for it at every
		// restart. The topology keeps AWS's floor (6 x the function's 1 s
		// timeout, for Lambda's retries); the queues get 3 s, enough for the
		// local runner, which handles one batch at a time.
		visibility := max(int(o.AckWait/time.Second), 3)
		topo := topology.Topology{Topic: topology.Topic{Name: "events.fifo", ThroughputScope: "MessageGroup"}}
		for _, name := range o.Consumers {
			topo.Consumers = append(topo.Consumers, topology.Consumer{Name: name,
				// The queue's own dead-lettering is a backstop behind the
				// handler's count of the event's failures.
				MaxReceiveCount: o.Retry.MaxRetries + 10, FunctionTimeoutSeconds: 1, VisibilityTimeoutSeconds: max(visibility, 6), MaxConcurrency: 2})
		}
		b := make([]byte, 4)
		_, _ = rand.Read(b)
		direct := awsConfig(t, ep)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		res, err := sns.Provision(ctx, awsclient.SNS(direct), awsclient.SQS(direct), topo,
			sns.ProvisionOptions{Prefix: "c" + hex.EncodeToString(b) + "-", VisibilityTimeoutSeconds: visibility})
		if err != nil {
			t.Fatalf("provision: %v", err)
		}
		sp := spec{Endpoint: ep, TopicARN: res.TopicARN, Queues: sns.Queues{}, Topology: topo, MaxRetries: o.Retry.MaxRetries,
			RetryDelay: time.Duration(o.Retry.InitialDelay)}
		for name, q := range res.Queues {
			sp.Queues[name] = sns.QueueURLs{QueueURL: q.URL, DLQURL: q.DLQURL}
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c := awsclient.SQS(direct)
			for _, q := range res.Queues {
				for _, u := range []string{q.URL, q.DLQURL} {
					_, _ = c.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(u)})
				}
			}
			_, _ = awsclient.SNS(direct).DeleteTopic(ctx, &snssvc.DeleteTopicInput{TopicArn: aws.String(res.TopicARN)})
		})
		// Every client of the deployment goes through a proxy the suite can cut.
		u, err := url.Parse(ep)
		if err != nil {
			t.Fatal(err)
		}
		px := transporttest.NewProxy(t, u.Host)
		d, err := newDeployment(awsConfig(t, "http://"+px.Addr()), sp)
		if err != nil {
			t.Fatal(err)
		}
		d.px, d.spec = px, sp
		return d
	},
	Rebuild: func(s string) (transporttest.Deployment, error) {
		var sp spec
		if err := json.Unmarshal([]byte(s), &sp); err != nil {
			return nil, err
		}
		cfg, err := config.LoadDefaultConfig(context.Background(), config.WithRegion("us-east-1"),
			config.WithCredentialsProvider(credentials.NewStaticCredentialsProvider("test", "test", "")), config.WithBaseEndpoint(sp.Endpoint))
		if err != nil {
			return nil, err
		}
		return newDeployment(cfg, sp)
	},
	Features: transporttest.Features{RedeliveryTimeout: true, Lambda: lambdaSource},
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func awsConfig(t *testing.T, endpoint string) aws.Config {
	t.Helper()
	return emulatortest.Config(t, endpoint)
}

// deployment is one test's topic and queues on the emulator.
type deployment struct {
	tr   *sns.Transport
	px   *transporttest.Proxy
	spec spec

	once sync.Once
	pub  transport.Publisher
	ops  transport.Operations
}

func newDeployment(cfg aws.Config, sp spec) (*deployment, error) {
	topo := sp.Topology
	tr, err := sns.New(sns.Config{SNS: awsclient.SNS(cfg), SQS: awsclient.SQS(cfg), TopicARN: sp.TopicARN, Queues: sp.Queues,
		Topology: &topo, RetryDelay: sp.RetryDelay, MaxRetries: sp.MaxRetries, Logger: quiet})
	if err != nil {
		return nil, err
	}
	return &deployment{tr: tr, spec: sp}, nil
}

func (d *deployment) init() {
	d.once.Do(func() {
		var err error
		if d.pub, err = d.tr.Publisher(); err != nil {
			panic(err)
		}
		if d.ops, err = d.tr.Operations(); err != nil {
			panic(err)
		}
	})
}

func (d *deployment) Publisher() outbox.Publisher      { d.init(); return d.pub }
func (d *deployment) Operations() transport.Operations { d.init(); return d.ops }
func (d *deployment) CutConnections(*testing.T) int    { return d.px.Cut() }
func (d *deployment) Spec() string {
	b, err := json.Marshal(d.spec)
	if err != nil {
		panic(err)
	}
	return string(b)
}

func (d *deployment) Runner(c string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error) {
	r, err := d.tr.ConsumerWith(c, db, apply, cc)
	if err != nil {
		return nil, err
	}
	return r, nil
}

// lambdaSource runs the SQS handler the way Lambda's SQS event source does
// (one receive, the handler, then the records not reported failed are
// deleted and the failed ones come back), through the local Runner's Poll.
func lambdaSource(t *testing.T, dep transporttest.Deployment, consumer string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) transporttest.LambdaSource {
	d := dep.(*deployment)
	r, err := d.tr.ConsumerWith(consumer, db, apply, cc)
	if err != nil {
		t.Fatal(err)
	}
	return &eventSource{r: r, margin: cc.DeadlineMargin}
}

type eventSource struct {
	r      *sns.Runner
	margin time.Duration
}

func (s *eventSource) Invoke(ctx context.Context, n int) (int, error) {
	r := *s.r
	if dl, ok := ctx.Deadline(); ok {
		r.HandlerTimeout = time.Until(dl)
	}
	return r.Poll(ctx, 1)
}
