// Package awsclient builds the AWS SDK clients fifobox uses (SNS, SQS,
// Lambda), once, from the standard environment (AWS_REGION,
// AWS_ENDPOINT_URL for LocalStack, Floci or the local emulator, credentials).
//
// Every client gets an HTTP transport that shields request bodies from an
// early Close: against a sub-millisecond local server, smithy-go can close
// the body while net/http is still sending it; net/http then drops the
// connection mid-response and the SDK retries, leaving SQS batches in flight
// for a whole visibility timeout. Real AWS latency hides this; the guard
// costs nothing there.
package awsclient

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/fifobox/fifobox/pkg/envspec"
)

// Env is what Load reads itself; the SDK reads the rest of the standard
// AWS_* variables (credentials, AWS_ENDPOINT_URL), which Lambda sets.
var Env = envspec.Set{
	{Name: "AWS_REGION", Reserved: true, Doc: "the region (set by Lambda)"},
	{Name: "AWS_DEFAULT_REGION", Reserved: true, Doc: "the region, older name (set by Lambda)"},
}

// Load returns the SDK configuration from the environment. Region defaults
// to us-east-1 when none is configured.
func Load(ctx context.Context) (aws.Config, error) {
	var opts []func(*config.LoadOptions) error
	if Env.Get("AWS_REGION") == "" && Env.Get("AWS_DEFAULT_REGION") == "" {
		opts = append(opts, config.WithRegion("us-east-1"))
	}
	cfg, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return aws.Config{}, fmt.Errorf("load AWS config: %w", err)
	}
	return cfg, nil
}

// HTTPClient returns the shared HTTP client with the body guard. Set it per
// service client (o.HTTPClient), not with config.WithHTTPClient: with
// AWS_CA_BUNDLE set, a custom client at config load can fail.
func HTTPClient() *http.Client {
	httpOnce.Do(func() {
		base := http.DefaultTransport.(*http.Transport).Clone()
		base.MaxIdleConns = 256
		base.MaxIdleConnsPerHost = 256
		base.IdleConnTimeout = 90 * time.Second
		httpClient = &http.Client{Transport: bodyGuard{base: base}}
	})
	return httpClient
}

var (
	httpOnce   sync.Once
	httpClient *http.Client
)

// bodyGuard hands the transport a body whose Close is deferred until the
// round trip has returned, so the SDK closing it early cannot cut the write.
type bodyGuard struct{ base http.RoundTripper }

func (g bodyGuard) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return g.base.RoundTrip(r)
	}
	orig := r.Body
	r2 := r.Clone(r.Context())
	r2.Body = io.NopCloser(orig)
	resp, err := g.base.RoundTrip(r2)
	orig.Close()
	return resp, err
}

// SNS returns an SNS client using the shared HTTP client.
func SNS(cfg aws.Config) *sns.Client {
	return sns.NewFromConfig(cfg, func(o *sns.Options) { o.HTTPClient = HTTPClient() })
}

// SQS returns an SQS client using the shared HTTP client.
func SQS(cfg aws.Config) *sqs.Client {
	return sqs.NewFromConfig(cfg, func(o *sqs.Options) { o.HTTPClient = HTTPClient() })
}
